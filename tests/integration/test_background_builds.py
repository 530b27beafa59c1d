"""Builds that never block serving, on a real daemon process.

A model whose engine is missing serves on a stand-in (the FP32 model on ONNX Runtime) right after
READY=1 while its engine builds in the child (slowed on purpose by the build child's test delay);
the built engine is then warmed and swapped in without a failed request. A new generation (the
cache key's generation tag, standing in for a TensorRT/driver upgrade) rebuilds every model in the
background while the old engines serve; old generations are collected once the new one is in.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from edged.tools.demo import make_tiny_mlp
from tests.helpers import DaemonProcess, RequestStream, wait_for
from tests.integration.mosquitto import Broker, Peer, broker
from tests.integration.test_faults import NotifySocket

__all__ = ["broker"]  # a fixture: imported so that pytest finds it

pytestmark = pytest.mark.integration

BACKGROUND = {"block_ready": False}  # the default of edged; the test fixtures default to true

X = np.ones((1, 16), np.float32)
DELAY_ENV = "EDGED_TEST_BUILD_DELAY_S"


def ref(model: Path) -> np.ndarray:
    return ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": X})[0]


def model_status(d: DaemonProcess, name: str = "m") -> dict[str, Any]:
    with d.client(timeout=5) as c:
        return dict(c.status()["models"][name])


def cache_keys(cache: Path, model: str = "m") -> set[str]:
    keys = set()
    for p in cache.glob(f"{model}-*.json"):
        keys.add(json.loads(p.read_text())["key"])
    return keys


def test_a_slow_build_serves_on_its_stand_in_then_swaps_without_a_failed_request(
    daemon_factory: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    model = make_tiny_mlp(tmp_path / "m.onnx")
    notify = NotifySocket(tmp_path / "notify.sock")
    try:
        d = daemon_factory(
            {"m": {"path": str(model)}},
            extra={"lifecycle": {"watch_files": False}, "build": BACKGROUND},
            env={DELAY_ENV: "m=4", "NOTIFY_SOCKET": str(notify.path)},
        )
        d.start()  # READY=1 does not wait for the 4 s build
        st = model_status(d)
        assert st["state"] == "ready" and st["fallback"], st
        assert st["reason"].startswith("serving on onnxruntime fp32 while building onnxruntime fp32"), st
        with RequestStream(d, ref(model)) as stream:
            wait_for(lambda: stream.ok > 20, 30, what="requests on the stand-in")
            wait_for(lambda: not model_status(d)["fallback"], 60, what="the swap to the built engine")
            before = stream.ok
            wait_for(lambda: stream.ok > before + 20, 30, what="requests on the built engine")
        assert stream.failures == []
        st = model_status(d)
        assert st["state"] == "ready" and st["cache_key"] in cache_keys(tmp_path / "cache") and st["reason"] == ""
        ready_lines = [m for m in notify.messages if "READY=1" in m]
        assert ready_lines and "while building onnxruntime fp32" in ready_lines[0], ready_lines
        assert any("STATUS=1 models ready" in m and "%)" in m for m in notify.messages)  # progress shown
        assert "now serving on onnxruntime fp32 (was onnxruntime fp32)" in d.log()
    finally:
        notify.close()


def test_a_cheap_engine_swapped_in_under_traffic_still_runs_on_the_loop(
    daemon_factory: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    """The built engine is warmed on a thread while its stand-in serves on the loop. That
    thread's runs wait for the GIL the busy loop holds: the tiny MLP measures 275-379 us there
    (20 us idle, 2-core machine), over the inline threshold, and judged by that alone it would run
    on its worker thread for the daemon's life at half the throughput. A cost in the band above
    the threshold is timed again on the loop (edged.serving.warmup.loop_cost_us). The threshold
    is raised so that the idle measurement is far below it on any host, and the thread's under
    traffic well above."""
    model = make_tiny_mlp(tmp_path / "m.onnx")
    d = daemon_factory(
        {"m": {"path": str(model), "threads": 1}},  # set, as the benchmark's: no thread trials
        extra={"lifecycle": {"watch_files": False}, "build": BACKGROUND, "server": {"inline_threshold_us": 150}},
        env={DELAY_ENV: "m=4"},
    )
    d.start()
    assert model_status(d)["inline"], model_status(d)  # the stand-in, measured before any traffic
    repo = Path(__file__).resolve().parents[2]
    flood = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.flood", str(d.socket)], cwd=repo, stderr=subprocess.PIPE, text=True
    )
    try:
        with RequestStream(d, ref(model), clients=1) as stream:
            wait_for(lambda: model_status(d)["requests"] > 200, 30, what="requests on the stand-in")
            assert model_status(d)["fallback"]  # the built engine is warmed under this traffic, not before it
            wait_for(lambda: not model_status(d)["fallback"], 60, what="the swap to the built engine")
        assert flood.poll() is None, flood.communicate()[1]  # every answer so far a 200
    finally:
        flood.kill()
        flood.wait()
    assert stream.failures == []
    st = model_status(d)
    assert st["inline"] and st["infer_us"] < 150, st


def test_block_ready_builds_before_ready(daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    model = make_tiny_mlp(tmp_path / "m.onnx")
    d = daemon_factory({"m": {"path": str(model)}}, extra={"build": {"block_ready": True}}, env={DELAY_ENV: "m=1"})
    d.start()
    st = model_status(d)
    assert st["state"] == "ready" and not st["fallback"] and st["cache_key"]


def test_a_new_generation_rebuilds_in_the_background_and_collects_the_old(
    daemon_factory: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    model = make_tiny_mlp(tmp_path / "m.onnx")
    cache = tmp_path / "cache"
    d = daemon_factory(
        {"m": {"path": str(model)}},
        extra={
            "lifecycle": {"watch_files": False},
            "cache": {"keep_generations": 1, "generation_tag": ""},
            "build": BACKGROUND,
        },
        env={DELAY_ENV: "m=3"},
    )
    d.start()
    wait_for(lambda: model_status(d)["cache_key"], 60, what="the first engine")
    first = model_status(d)["cache_key"]
    assert cache_keys(cache) == {first}
    # An upgrade changes the fingerprint in every key; the generation tag does the same on purpose.
    d.config.write_text(d.config.read_text().replace('generation_tag = ""', 'generation_tag = "v2"'))
    with RequestStream(d, ref(model)) as stream:
        assert d.proc is not None
        d.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "while building" in model_status(d)["reason"], 30, what="the background rebuild")
        st = model_status(d)
        assert st["state"] == "ready" and st["cache_key"] == first  # the old engine keeps serving
        assert cache_keys(cache) == {first}  # and its generation stays until the new one is in
        wait_for(lambda: model_status(d)["cache_key"] not in (None, first), 60, what="the new generation")
        before = stream.ok
        wait_for(lambda: stream.ok > before + 20, 30, what="requests on the new engine")
    assert stream.failures == []
    second = model_status(d)["cache_key"]
    wait_for(lambda: cache_keys(cache) == {second}, 30, what="the old generation to be collected")
    assert not list(cache.glob(f"m-{first[:20]}*"))
    # A restart with the new generation in the cache builds nothing and serves the engine at once.
    assert d.stop() == 0
    d.log_path.write_text("")
    d.start()
    st = model_status(d)
    assert st["cache_key"] == second and not st["fallback"]
    assert "building" not in d.log()


def test_a_restart_after_an_upgrade_serves_at_once(
    daemon_factory: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    model = make_tiny_mlp(tmp_path / "m.onnx")
    d = daemon_factory(
        {"m": {"path": str(model)}}, extra={"build": {"block_ready": True}, "cache": {"generation_tag": ""}}
    )
    d.start()
    first = model_status(d)["cache_key"]
    assert d.stop() == 0
    text = d.config.read_text().replace('generation_tag = ""', 'generation_tag = "v2"')
    d.config.write_text(text.replace("block_ready = true", "block_ready = false"))
    d.env[DELAY_ENV] = "m=3"
    d.log_path.write_text("")
    d.start()
    st = model_status(d)
    assert st["state"] == "ready" and st["fallback"], st  # serving within the start-up, not after the build
    assert first in cache_keys(tmp_path / "cache")
    wait_for(lambda: model_status(d)["cache_key"] not in (None, first), 60, what="the rebuilt engine")


def test_mqtt_state_says_what_serves_while_the_engine_builds(
    daemon_factory: Callable[..., DaemonProcess], tmp_path: Path, broker: Broker
) -> None:
    model = make_tiny_mlp(tmp_path / "m.onnx")
    d = daemon_factory(
        {"m": {"path": str(model)}},
        extra={
            "lifecycle": {"watch_files": False},
            "build": BACKGROUND,
            "mqtt": {"enabled": True, "host": "127.0.0.1", "port": broker.port, "device_id": "dev1"},
        },
        env={DELAY_ENV: "m=3"},
    )
    with Peer(broker.port) as peer:
        peer.subscribe("edged/dev1/models/m/state")
        d.start()
        building = peer.first(
            "edged/dev1/models/m/state", lambda r: "while building" in r.json()["reason"], timeout=30
        ).json()
        assert building["state"] == "ready"
        assert building["reason"].startswith("serving on onnxruntime fp32 while building onnxruntime fp32")
        done = peer.first(
            "edged/dev1/models/m/state",
            lambda r: r.json()["state"] == "ready" and r.json()["reason"] == "",
            timeout=60,
        ).json()
        assert done["model"] == "m"
    assert not model_status(d)["fallback"]


def test_a_model_added_by_a_reload_serves_on_its_stand_in_at_once(
    daemon_factory: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    a, b = make_tiny_mlp(tmp_path / "a.onnx"), make_tiny_mlp(tmp_path / "m.onnx", hidden=20)
    d = daemon_factory(
        {"a": {"path": str(a)}},
        extra={"lifecycle": {"watch_files": False}, "build": BACKGROUND},
        env={DELAY_ENV: "m=4"},
    )
    d.start()
    wait_for(lambda: model_status(d, "a")["cache_key"], 60, what="a built")
    d.config.write_text(d.config.read_text() + f'\n[models.m]\npath = "{b}"\n')
    assert d.proc is not None
    d.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "reload done" in d.log(), 30, what="the reload, which does not wait for the build")
    st = model_status(d)
    assert st["state"] == "ready" and st["fallback"] and "while building" in st["reason"], st
    with d.client() as c:
        np.testing.assert_allclose(c.infer("m", {"x": X})["probs"], ref(b), rtol=1e-5)
    wait_for(lambda: not model_status(d)["fallback"], 60, what="the swap to the built engine")
    with d.client() as c:
        np.testing.assert_allclose(c.infer("m", {"x": X})["probs"], ref(b), rtol=1e-5)


def test_an_engine_of_another_precision_already_built_stands_in(
    daemon_factory: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    """A model switched from fp32 to int8 serves on its fp32 engine (no ONNX Runtime session on the
    source model) while the int8 engine is calibrated and built."""
    model = make_tiny_mlp(tmp_path / "m.onnx")
    samples = tmp_path / "samples"
    samples.mkdir()
    rng = np.random.default_rng(3)
    for i in range(12):
        np.save(samples / f"{i:02}.npy", rng.standard_normal((1, 16)).astype(np.float32))
    d = daemon_factory({"m": {"path": str(model)}}, extra={"lifecycle": {"watch_files": False}})
    d.start()  # block_ready (the fixture's default): the fp32 engine is built
    fp32_key = model_status(d)["cache_key"]
    assert d.stop() == 0
    text = d.config.read_text().replace("block_ready = true", "block_ready = false")
    d.config.write_text(
        text + f'\n[models.m.calibration]\ndata = "{samples}"\n[models.m.gate]\nmax_rel_l2 = 0.5\nmin_cosine = 0.5\n'
    )
    d.config.write_text(d.config.read_text().replace(f'path = "{model}"', f'path = "{model}"\nprecision = "int8"'))
    d.env[DELAY_ENV] = "m=3"
    d.log_path.write_text("")
    d.start()
    st = model_status(d)
    assert st["fallback"] and st["precision"] == "fp32", st
    assert st["backend_reason"].startswith("stand-in: the fp32 engine already built"), st
    assert st["reason"].startswith("serving on onnxruntime fp32 while building onnxruntime int8"), st
    with d.client() as c:
        np.testing.assert_allclose(c.infer("m", {"x": X})["probs"], ref(model), rtol=1e-5)
    wait_for(lambda: not model_status(d)["fallback"], 90, what="the int8 build to be swapped in")
    st = model_status(d)
    assert st["cache_key"] != fp32_key or st["precision_reason"], st  # int8, or fp32 with the gate's reason
