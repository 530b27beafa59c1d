"""A fleet on this machine: six real daemons on a device-side mosquitto bridged to a central one,
signed bundles rolled out by the real `edged fleet rollout` command, which talks only to the
central broker.

The daemons are shared by the tests of this module, which run in order: each rolls out a newer
version than the last (the devices' anti-rollback floor only rises), so every test starts from a
fleet that serves the previous test's version.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from edged.fleet import desired, protocol
from edged.tools.demo import make_tiny_mlp
from tests.bundle_server import BundleServer, bundle_server
from tests.fleet_keys import KeyPair, make_key
from tests.helpers import REPO, DaemonProcess, raw_http, wait_for
from tests.integration import fleet_net
from tests.integration.fleet_net import GROUP, MISSED_GATE, Observer, Release, release
from tests.integration.mosquitto import Broker, Peer, need

pytestmark = pytest.mark.integration

DEVICES = 6
X = np.ones((1, 16), np.float32)


@dataclass
class Fleet:
    root: Path
    central: Broker
    edge: Broker
    key: KeyPair
    peer: Observer
    server: BundleServer
    devices: dict[str, DaemonProcess] = field(default_factory=dict)

    def state(self, name: str) -> dict[str, Any]:
        got = self.peer.on(protocol.device_state("edged", name))
        return json.loads(got[-1].payload) if got else {}

    def model(self, name: str) -> dict[str, Any]:
        m: dict[str, Any] = self.state(name).get("models", {}).get("m", {})
        return m

    def wait_all(self, pred: Any, what: str, names: list[str] | None = None, timeout: float = 90) -> None:
        names = names or list(self.devices)
        wait_for(lambda: all(pred(self.model(n)) for n in names), timeout, 0.1, what)

    def rollout(self, rel: Release, *args: str) -> subprocess.Popen[str]:
        cmd = [sys.executable, "-m", "edged", "fleet", "rollout", str(rel.archive), "--group", GROUP]
        cmd += ["--broker", f"127.0.0.1:{self.central.port}", "--stage-timeout", "90", *args]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)

    def answers(self, name: str) -> np.ndarray:
        with self.devices[name].client() as c:
            return np.asarray(c.infer("m", {"x": X})["probs"])


def reference(rel_folder: Path, hidden: int) -> np.ndarray:
    path = make_tiny_mlp(rel_folder / f"ref-{hidden}.onnx", hidden=hidden)
    return np.asarray(ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": X})[0])


def metric(d: DaemonProcess, line_start: str) -> float:
    _, body, _ = raw_http(d.socket, "GET", "/metrics")
    for line in body.decode().splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    need("mosquitto", "mosquitto")
    root = tmp_path_factory.mktemp("fleet")
    central, edge = Broker(root / "central"), Broker(root / "edge")
    fleet_net.bridge(edge, central)
    central.start()
    edge.start()
    key = make_key(root, "release")
    model = make_tiny_mlp(root / "m0.onnx")
    (root / "www").mkdir()
    peer = Observer(central.port, [protocol.all_states("edged")])
    with bundle_server(root / "www") as server, peer:
        f = Fleet(root, central, edge, key, peer, server)
        for i in range(DEVICES):
            name = f"cam-{i}"
            f.devices[name] = fleet_net.device(root / name, name, edge.port, key.public, model)
        try:
            for d in f.devices.values():
                d.start(wait_ready=False)
            for d in f.devices.values():
                d.wait_ready(120)
            wait_for(lambda: all(f.state(n) for n in f.devices), 30, 0.1, "every device's first state report")
            yield f
        finally:
            for d in f.devices.values():
                d.stop(15)
                d.kill()
            edge.stop()
            central.stop()


def test_a_signed_bundle_rolls_out_in_stages_to_every_device(fleet: Fleet) -> None:
    rel = release(fleet.root / "rel", "1.0.0", fleet.key.private, hidden=48)
    proc = fleet.rollout(rel, "--stages", "1,50,100", "--max-failures", "2%")
    out, _ = proc.communicate(timeout=150)
    assert proc.returncode == 0, out
    assert "stage 1% (1 of 6 devices)" in out and "stage 50% (3 of 6 devices)" in out, out
    assert "rolled out to 6 devices" in out
    fleet.wait_all(lambda m: m.get("version") == "1.0.0" and m.get("phase") == "serving", "every device on 1.0.0")
    # Stage by stage: the first device served before the second stage's devices began.
    since = {n: fleet.model(n)["since"] for n in fleet.devices}
    assert since["cam-0"] < min(since[n] for n in ("cam-1", "cam-2")) < min(since[n] for n in ("cam-3", "cam-5"))
    ref = reference(fleet.root, 48)
    for name, d in fleet.devices.items():
        np.testing.assert_allclose(fleet.answers(name), ref, rtol=1e-5)
        assert metric(d, 'edged_model_version_info{model="m",phase="serving",version="1.0.0"}') == 1.0
    assert fleet.state("cam-0")["fingerprint"]["onnxruntime"], fleet.state("cam-0")
    status = subprocess.run(
        [
            sys.executable,
            "-m",
            "edged",
            "fleet",
            "status",
            "--group",
            GROUP,
            "--broker",
            f"127.0.0.1:{fleet.central.port}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert status.returncode == 0 and "group line-1: 6 devices" in status.stdout, status
    assert "phases: serving 6" in status.stdout and "rollout m 1.0.0: done" in status.stdout, status.stdout
    with Peer(fleet.central.port) as p:  # heartbeats reach the central broker, one topic per device
        p.subscribe(protocol.heartbeat("edged", GROUP, "+"), qos=0)
        beat = p.first(protocol.heartbeat("edged", GROUP, "cam-3"), timeout=10)
    doc = beat.json()
    assert doc["d"] == "cam-3" and doc["ok"] == 1 and doc["m"]["m"][:2] == ["1.0.0", "serving"], doc
    assert len(beat.payload) + len(beat.topic) + 4 <= 1024  # a minute's budget, at one a minute
    with Peer(fleet.central.port) as p:  # the stage overrides are cleared: the group's state says it
        p.subscribe(protocol.device_desired("edged", "+"))
        p.subscribe(protocol.rollout("edged", GROUP))
        status = p.first(protocol.rollout("edged", GROUP)).json()
        assert status["state"] == "done" and status["serving"] == DEVICES, status
        assert not [r for r in p.received if r.topic.endswith("/fleet/desired") and r.payload]


def test_tampered_and_replayed_bundles_are_refused_everywhere_with_nothing_built(fleet: Fleet) -> None:
    builds = {n: metric(d, 'edged_builds_total{model="m",outcome="ok"}') for n, d in fleet.devices.items()}
    other = make_key(fleet.root, "stranger")
    cases = [
        (release(fleet.root / "rel", "1.1.0", fleet.key.private, hidden=40, tamper=True), "file_modified"),
        (release(fleet.root / "rel", "1.2.0", other.private, hidden=40), "untrusted_signer"),
        (release(fleet.root / "rel", "0.9.0", fleet.key.private, hidden=40), "version_replayed"),
    ]
    topic = protocol.group_desired("edged", GROUP)
    events = Observer(fleet.central.port, [protocol.device_events("edged", "+")])
    with events:
        for rel, code in cases:
            fleet.peer.client.publish(topic, desired.encode({"m": rel.target()}), qos=1, retain=True)
            fleet.wait_all(
                lambda m, v=rel.version: m.get("target") == v and m.get("phase") == "refused", f"{rel.version} refused"
            )
            for name in fleet.devices:
                m = fleet.model(name)
                assert m["version"] == "1.0.0" and m["reason"].endswith(f"({code})"), (name, m)
        wait_for(lambda: len(events.received) == 3 * DEVICES, 30, 0.1, "a refusal event per device and bundle")
    assert sorted({r.json()["code"] for r in events.received}) == [
        "file_modified",
        "untrusted_signer",
        "version_replayed",
    ]
    assert "not newer than 1.0.0" in fleet.model("cam-0")["reason"]
    for name, d in fleet.devices.items():
        assert metric(d, 'edged_builds_total{model="m",outcome="ok"}') == builds[name]  # nothing built
        for _, code in cases:
            assert metric(d, f'edged_fleet_bundle_refusals_total{{reason="{code}"}}') == 1.0
        np.testing.assert_allclose(fleet.answers(name), reference(fleet.root, 48), rtol=1e-5)
        assert len(list((fleet.root / name / "cache" / "fleet" / "archives").glob("*.bundle"))) == 1  # 1.0.0's
        with d.client() as c:
            section = c.status()["fleet"]
        assert section["bundle_refusals"]["m"]["code"] == "version_replayed", section
        assert section["models"]["m"]["phase"] == "refused", section
    # A hostile desired-state message is refused with its reason, and changes nothing.
    fleet.peer.client.publish(topic, b'{"models": {"../../etc": {}}}', qos=1, retain=True)
    wait_for(lambda: all("bad_field" in fleet.state(n).get("refused", "") for n in fleet.devices), 30, 0.1, "refusal")
    assert all(fleet.model(n)["version"] == "1.0.0" for n in fleet.devices)


def test_a_bundle_that_misses_its_gate_rolls_back_and_pauses_the_rollout(fleet: Fleet) -> None:
    rel = release(fleet.root / "rel", "2.0.0", fleet.key.private, hidden=40, model=MISSED_GATE)
    proc = fleet.rollout(rel, "--stages", "1,50,100", "--max-failures", "2%")
    out, _ = proc.communicate(timeout=150)
    assert proc.returncode == 3, out
    assert "paused: stage 1% (1 of 6 devices): 1 of 1 failed (100% > 2%): cam-0: rolled back" in out, out
    m = fleet.model("cam-0")
    assert m["phase"] == "rolled back" and m["version"] == "1.0.0" and "accuracy gate" in m["reason"], m
    assert m["gate"]["passed"] is False and m["gate"]["rel_l2"] > 1e-9, m
    np.testing.assert_allclose(fleet.answers("cam-0"), reference(fleet.root, 48), rtol=1e-5)
    for name in list(fleet.devices)[1:]:  # the rollout stopped before them
        assert fleet.model(name)["target"] != "2.0.0", fleet.model(name)
    with Peer(fleet.central.port) as p:
        p.subscribe(protocol.rollout("edged", GROUP))
        status = p.first(protocol.rollout("edged", GROUP)).json()
    assert status["state"] == "paused" and "cam-0" in status["failed"], status


def test_a_broker_restart_mid_rollout_loses_nothing(fleet: Fleet) -> None:
    rel = release(fleet.root / "rel", "3.0.0", fleet.key.private, hidden=56)
    proc = fleet.rollout(rel, "--stages", "1,50,100", "--max-failures", "2%")
    try:
        fleet.wait_all(lambda m: m.get("version") == "3.0.0", "the first stage", ["cam-0"])
        fleet.central.restart()  # the controller's broker and the far end of the bridge
        fleet.wait_all(lambda m: m.get("target") == "3.0.0", "the second stage", ["cam-1"])
        fleet.edge.restart()  # the devices' broker
        out, _ = proc.communicate(timeout=150)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    fleet.wait_all(lambda m: m.get("version") == "3.0.0" and m.get("phase") == "serving", "every device on 3.0.0")
    for name in fleet.devices:
        np.testing.assert_allclose(fleet.answers(name), reference(fleet.root, 56), rtol=1e-5)


def test_a_device_restarted_mid_download_resumes_with_a_range_request(fleet: Fleet) -> None:
    rel = release(fleet.root / "rel", "4.0.0", fleet.key.private, hidden=24, pad=1_500_000)
    (fleet.root / "www" / rel.archive.name).write_bytes(rel.archive.read_bytes())
    fleet.server.pace[rel.archive.name] = 400_000  # bytes a second: a few seconds' download
    name, d = "cam-5", fleet.devices["cam-5"]
    topic = protocol.device_desired("edged", name)
    fleet.peer.client.publish(
        topic, desired.encode({"m": rel.target(fleet.server.url(rel.archive.name))}), qos=1, retain=True
    )
    wait_for(lambda: fleet.server.sent(rel.archive.name) >= 400_000, 60, 0.05, "part of the download")
    assert d.proc is not None
    d.proc.send_signal(signal.SIGKILL)  # a reboot: nothing is flushed or closed by edged
    d.proc.wait(10)
    d.start(timeout=120)
    fleet.wait_all(
        lambda m: m.get("version") == "4.0.0" and m.get("phase") == "serving", "4.0.0 after the restart", [name]
    )
    ranges = fleet.server.ranges(rel.archive.name)
    assert ranges[0] == "" and ranges[-1].startswith("bytes="), ranges
    resumed_at = int(ranges[-1][6:].rstrip("-"))
    assert resumed_at >= 300_000, ranges
    assert fleet.server.sent(rel.archive.name) < rel.size * 1.5  # the rest, not all of it again
    np.testing.assert_allclose(fleet.answers(name), reference(fleet.root, 24), rtol=1e-5)


def test_a_version_whose_traffic_fails_is_rolled_back_within_its_watch(fleet: Fleet) -> None:
    """5.0.0 takes 8 inputs where clients send 16: every request fails once it serves, and the
    watch of its first seconds of traffic puts 3.0.0 back."""
    name, d = "cam-4", fleet.devices["cam-4"]
    d.stop(15)
    text = d.config.read_text().replace("watch_s = 0", "watch_s = 20\nmin_requests = 20")
    d.config.write_text(text)
    d.start(timeout=120)
    rel = release(fleet.root / "rel", "5.0.0", fleet.key.private, hidden=32, in_dim=8)
    topic = protocol.device_desired("edged", name)
    fleet.peer.client.publish(topic, desired.encode({"m": rel.target()}), qos=1, retain=True)
    fleet.wait_all(lambda m: m.get("phase") == "watching", "5.0.0 under watch", [name])
    failures = 0
    with d.client() as c:
        while fleet.model(name).get("phase") == "watching":
            try:
                c.infer("m", {"x": X})
            except Exception:
                failures += 1
    m = fleet.model(name)
    assert m["phase"] == "rolled back" and m["version"] == "3.0.0", m
    assert m["reason"].startswith("error rate 100.0% over"), m
    assert failures >= 20
    np.testing.assert_allclose(fleet.answers(name), reference(fleet.root, 56), rtol=1e-5)
