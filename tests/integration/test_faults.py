"""Faults that could take the daemon down or leave it wrong, on a real daemon process.

Each test states the fault and what must hold: a build timeout fails one model, signals during the
start-up are survived, start-up failures exit 78/1 with one line and run the stop path, reloads are
transactional, a failed load holds no memory, readiness tells the truth, a sub-second drain drains.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from edged.tools.demo import make_tiny_mlp
from tests.helpers import FREEZE_S, DaemonProcess, loop_stalls, unavailable, wait_for

pytestmark = pytest.mark.integration

X = np.ones((1, 16), np.float32)
DELAY_ENV = "EDGED_TEST_BUILD_DELAY_S"


def ref(model: Path, x: np.ndarray = X) -> np.ndarray:
    return ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def status(d: DaemonProcess) -> dict[str, Any]:
    with d.client(timeout=5) as c:
        return c.status()


def logged(d: DaemonProcess, text: str, times: int) -> Callable[[], bool]:
    """A wait_for condition: ``text`` is in the daemon's log at least ``times`` times."""
    return lambda: d.log().count(text) >= times


class NotifySocket:
    """systemd's end of sd_notify: a datagram socket the daemon sends READY/RELOADING/STATUS to."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.messages.append(self.sock.recv(65536).decode())
            except TimeoutError:
                continue
            except OSError:
                return

    def lines(self) -> list[str]:
        return [line for m in list(self.messages) for line in m.splitlines()]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def notify(tmp_path: Path) -> Iterator[NotifySocket]:
    n = NotifySocket(tmp_path / "notify.sock")
    yield n
    n.close()


def hup(d: DaemonProcess) -> None:
    assert d.proc is not None
    d.proc.send_signal(signal.SIGHUP)


# --- build timeout -----------------------------------------------------------------------------


def test_build_timeout_fails_that_model_only(daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    good = make_tiny_mlp(tmp_path / "good.onnx")
    slow = make_tiny_mlp(tmp_path / "slow.onnx", hidden=24)
    d = daemon_factory(
        {"good": {"path": str(good)}, "slow": {"path": str(slow)}},
        extra={"build": {"timeout_s": 8, "block_ready": True}, "lifecycle": {"watch_files": False}},
        env={DELAY_ENV: "slow=120"},
    )
    d.start(wait_ready=False)
    with d.client(timeout=5) as c:
        wait_for(lambda: c.status()["models"]["slow"]["state"] == "failed", 60, what="the timed-out build to fail")
        st = c.status()
        assert "build.timeout_s" in st["models"]["slow"]["reason"]
        np.testing.assert_allclose(c.infer("good", {"x": X})["probs"], ref(good), rtol=1e-5)
    assert d.proc is not None and d.proc.poll() is None, d.log()
    assert "Traceback" not in d.log()


def test_build_timeout_during_reload_keeps_the_daemon_and_the_watcher(
    daemon_factory: Callable[..., DaemonProcess], tmp_path: Path, notify: NotifySocket
) -> None:
    a = make_tiny_mlp(tmp_path / "a.onnx")
    d = daemon_factory(
        {"a": {"path": str(a)}},
        extra={"build": {"timeout_s": 8, "block_ready": True}, "lifecycle": {"watch_interval_s": 0.2}},
        env={DELAY_ENV: "b=120", "NOTIFY_SOCKET": str(notify.path)},
    )
    d.start()
    b = make_tiny_mlp(tmp_path / "b.onnx", hidden=20)
    d.config.write_text(d.config.read_text() + f'\n[models.b]\npath = "{b}"\n')  # the watcher reloads
    wait_for(lambda: "reload failed" in status(d)["status"], 60, what="the reload to fail")
    assert "build.timeout_s" in status(d)["status"]
    lines = notify.lines()
    assert "RELOADING=1" in lines and lines[len(lines) - 1 - lines[::-1].index("RELOADING=1") :].count("READY=1") == 1
    # The watcher lives on: the next change is picked up (and this time builds nothing).
    d.config.write_text(d.config.read_text().replace(f'\n[models.b]\npath = "{b}"\n', ""))
    wait_for(lambda: "reload done" in d.log(), 60, what="a later reload to succeed")
    assert "reload failed" not in status(d)["status"]
    with d.client() as c:
        assert c.infer("a", {"x": X})["probs"].shape == (1, 4)
    assert d.proc is not None and d.proc.poll() is None


# --- signals and start-up failures ---------------------------------------------------------------


def test_sighup_and_sigint_during_start_up_are_survived(
    daemon_factory: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    m = make_tiny_mlp(tmp_path / "m.onnx")
    d = daemon_factory(
        {"m": {"path": str(m)}},
        extra={"build": {"block_ready": True}, "lifecycle": {"watch_files": False}},
        env={DELAY_ENV: "3"},
    )
    d.start(wait_ready=False)
    assert d.proc is not None
    wait_for(lambda: d.socket.exists(), 30, what="the socket")
    with d.client(timeout=5) as c:
        wait_for(lambda: c.status()["builds"], 30, what="the build to start")
    hup(d)  # before READY=1: survived, not an exit 129 that would orphan the build child
    hup(d)
    d.wait_ready(60)
    wait_for(lambda: "reload done" in d.log(), 30, what="the reload asked for during the start-up")
    assert "SIGHUP during start-up" in d.log()
    with d.client() as c:
        np.testing.assert_allclose(c.infer("m", {"x": X})["probs"], ref(m), rtol=1e-5)
    d.proc.send_signal(signal.SIGINT)
    assert d.proc.wait(30) == 0
    assert not d.socket.exists()


def _exit_of(d: DaemonProcess) -> int:
    d.start(wait_ready=False)
    assert d.proc is not None
    return d.proc.wait(60)


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"server": {"socket_group": "no-such-group-edged"}}, "server.socket_group"),
        ({"memory": {"probe": "nvml"}}, "memory.probe"),
        ({"mqtt": {"enabled": True, "device_id": "cam/+"}}, "mqtt.device_id"),
    ],
    ids=["socket-group", "nvml-probe", "mqtt-topic"],
)
def test_configuration_problems_at_start_exit_78_with_one_line(
    daemon_factory: Callable[..., DaemonProcess], tmp_path: Path, extra: dict, key: str
) -> None:
    m = make_tiny_mlp(tmp_path / "m.onnx")
    d = daemon_factory({"m": {"path": str(m)}}, extra=extra)
    assert _exit_of(d) == 78, d.log()
    log = d.log()
    assert "Traceback" not in log
    errors = [line for line in log.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "cannot start" in errors[0] and key in errors[0], log
    assert not d.socket.exists()
    assert "stopped in" in log  # the stop path ran


def test_any_other_start_up_failure_exits_1_with_one_line(
    daemon_factory: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory's parent should be")
    m = make_tiny_mlp(tmp_path / "m.onnx")
    d = daemon_factory({"m": {"path": str(m)}})
    d.config.write_text(d.config.read_text().replace(str(tmp_path / "cache"), str(blocker / "cache")))
    assert _exit_of(d) == 1, d.log()
    log = d.log()
    assert "Traceback" not in log
    errors = [line for line in log.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "cannot start" in errors[0], log
    assert "stopped in" in log


# --- transactional reload ------------------------------------------------------------------------


def test_reload_is_transactional(daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    a, b = make_tiny_mlp(tmp_path / "a.onnx"), make_tiny_mlp(tmp_path / "b.onnx", hidden=20)
    d = daemon_factory(
        {"a": {"path": str(a)}, "b": {"path": str(b)}},
        extra={"lifecycle": {"watch_files": False}, "build": {"block_ready": True}},
    )
    d.start()
    keys = {n: m["cache_key"] for n, m in status(d)["models"].items()}
    a2 = make_tiny_mlp(tmp_path / "a2.onnx", hidden=40)
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not a model")
    good_cfg = d.config.read_text()
    d.config.write_text(good_cfg.replace(str(a), str(a2)).replace(str(b), str(broken)))
    for attempt in (1, 2):  # the second SIGHUP fails too: no success reported with b left on its old config
        hup(d)
        wait_for(logged(d, "reload failed", attempt), 60, what=f"reload {attempt} to fail")
        st = status(d)
        assert "reload failed" in st["status"], st["status"]
        assert {n: m["cache_key"] for n, m in st["models"].items()} == keys  # a was not swapped
        with d.client() as c:
            np.testing.assert_allclose(c.infer("a", {"x": X})["probs"], ref(a), rtol=1e-5)
    d.config.write_text(good_cfg.replace(str(a), str(a2)))
    hup(d)
    wait_for(lambda: "reload done" in d.log(), 60, what="a good reload")
    assert "reload failed" not in status(d)["status"]
    with d.client() as c:
        np.testing.assert_allclose(c.infer("a", {"x": X})["probs"], ref(a2), rtol=1e-5)
        np.testing.assert_allclose(c.infer("b", {"x": X})["probs"], ref(b), rtol=1e-5)


# --- a failed load ---------------------------------------------------------------------------------


def test_a_model_that_fails_warm_up_holds_no_memory(
    daemon_factory: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    m = make_tiny_mlp(tmp_path / "m.onnx")
    ok = make_tiny_mlp(tmp_path / "ok.onnx", hidden=20)
    np.save(tmp_path / "wrong.npy", np.ones((1, 7), np.float32))  # warm-up input of the wrong shape
    d = daemon_factory(
        {"bad": {"path": str(m), "warmup": {"inputs": str(tmp_path / "wrong.npy")}}, "ok": {"path": str(ok)}},
        extra={"lifecycle": {"watch_files": False}},
    )
    d.start(wait_ready=False)
    with d.client(timeout=5) as c:
        wait_for(lambda: c.status()["models"]["ok"]["state"] == "ready", 60, what="ok ready")
        wait_for(lambda: c.status()["models"]["bad"]["state"] == "failed", 60, what="bad failed")
        st = c.status()
        assert st["memory"]["used_bytes"] == st["models"]["ok"]["footprint_bytes"]
        c.unload("bad")  # a failed model has no backend left to hold: unloading it is possible
        assert c.status()["memory"]["used_bytes"] == st["models"]["ok"]["footprint_bytes"]


# --- readiness -------------------------------------------------------------------------------------


def test_not_ready_while_no_boot_model_serves(daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    """A boot model that failed does not count as ready: with none serving, the daemon is not
    ready; a boot model that failed is degraded with its reason (in the status); ready needs every
    boot model settled and at least one serving."""
    m = make_tiny_mlp(tmp_path / "m.onnx")
    d = daemon_factory(
        {"m": {"path": str(m), "preload": "lazy"}, "gone": {"path": str(tmp_path / "missing.onnx")}},
        extra={"lifecycle": {"watch_files": False}},
    )
    d.start(wait_ready=False)
    with d.client(timeout=5) as c:
        wait_for(lambda: "1 failed" in c.status()["status"], 60, what="start-up done")
        code, body, _ = c.request("GET", "/v2/health/ready")
        assert code == 503 and b"missing.onnx" in body, body
        assert c.live()
        assert c.infer("m", {"x": X})["probs"].shape == (1, 4)  # what can serve, serves
    d.stop()
    d.config.write_text(d.config.read_text().replace('preload = "lazy"', 'preload = "boot"'))
    d.start()  # m serving at boot: ready, with the failed model's reason in the status
    with d.client(timeout=5) as c:
        code, body, _ = c.request("GET", "/v2/health/ready")
        assert code == 200 and b"missing.onnx" in body, body


# --- drain -----------------------------------------------------------------------------------------


def test_a_drain_below_one_second_still_drains(daemon_factory: Callable[..., DaemonProcess], demo_models: Path) -> None:
    d = daemon_factory(
        {
            "m": {
                "path": str(demo_models),
                "backend": "onnxruntime",
                "profiles": {"x": {"min": [1, 3, 32, 32], "opt": [1, 3, 64, 64], "max": [1, 3, 640, 640]}},
            }
        },
        extra={"lifecycle": {"drain_timeout_s": 0.9, "watch_files": False}},
    )
    d.start()
    frame = np.random.default_rng(0).random((1, 3, 480, 480), dtype=np.float32)
    results: list[object] = []

    def one() -> None:
        try:
            with d.client() as c:
                results.append(c.infer("m", {"x": frame}))
        except Exception as e:
            results.append(e)

    t = threading.Thread(target=one)
    t.start()
    with d.client() as c:
        wait_for(lambda: c.status()["models"]["m"]["queue"] >= 1, 30, 0.001, what="a request in flight")
    assert d.proc is not None
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(30) == 0
    t.join(30)
    assert len(results) == 1 and isinstance(results[0], dict), results  # int(0.9) == 0 cut it off


# --- a full disk -----------------------------------------------------------------------------------


def test_a_full_cache_disk_says_so_and_leaves_the_cache_consistent(
    daemon_factory: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    if os.geteuid() != 0:
        unavailable("needs root for a private mount namespace with a small tmpfs as the cache")
    big = make_tiny_mlp(tmp_path / "big.onnx", hidden=60_000)  # about 5 MB; the cache holds 2 MB
    d = daemon_factory(
        {"big": {"path": str(big)}}, extra={"lifecycle": {"watch_files": False}, "build": {"block_ready": False}}
    )
    cache = tmp_path / "cache"
    cache.mkdir()
    script = f'mount -t tmpfs -o size=2m tmpfs "{cache}" && exec "$0" -m edged serve --config "{d.config}"'
    with open(d.log_path, "ab") as log:
        d.proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, sys.executable],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=d.env,
            start_new_session=True,
        )
    with d.client(timeout=5) as c:
        wait_for(lambda: "build failed" in c.status()["models"]["big"]["reason"], 120, 0.1, what="the build to fail")
        st = c.status()["models"]["big"]
        assert "no space left on device (ENOSPC)" in st["reason"], st
        assert "Protobuf" not in st["reason"]
        assert st["state"] == "ready" and st["fallback"]  # the stand-in keeps serving
        assert c.infer("big", {"x": X})["probs"].shape == (1, 4)
    # What the cache holds, seen from inside the daemon's mount namespace: no temporaries, no entry.
    listing = subprocess.run(
        ["nsenter", "-t", str(d.proc.pid), "-m", "find", str(cache), "-type", "f"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert not [p for p in listing if Path(p).name.startswith(".tmp-") or Path(p).suffix == ".onnx"], listing


# --- nothing blocking on the loop -------------------------------------------------------------------


def bytes_read(d: DaemonProcess) -> int:
    """What the daemon's process has read so far (files, sockets, pipes: read(2) and the like)."""
    assert d.proc is not None
    for line in Path(f"/proc/{d.proc.pid}/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError(f"no rchar in /proc/{d.proc.pid}/io")


def test_a_no_op_reload_with_a_large_engine_does_not_stall_the_loop(
    daemon_factory: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    """A reload that changes nothing reads neither the model nor the engine again: their digests
    are trusted by (size, mtime, inode), so there is no hashing of hundreds of megabytes to stall
    the loop (a re-hash on the loop takes 73-77 ms per 128 MiB where measured). Behind that, the
    loop's own watch: no stall of FREEZE_S or more across the reloads."""
    big = make_tiny_mlp(tmp_path / "big.onnx", hidden=2_500_000)  # a 200 MB model, and a 200 MB engine
    d = daemon_factory(
        {"big": {"path": str(big)}},
        extra={
            "build": {"block_ready": True},
            "lifecycle": {"watch_files": False, "loop_stall_ms": int(FREEZE_S * 1000)},
        },
    )
    d.start(timeout=180)
    before, read_before = loop_stalls(d), bytes_read(d)
    for n in (1, 2, 3):
        hup(d)
        wait_for(logged(d, "reload done", n), 60, what=f"reload {n}")
    read = bytes_read(d) - read_before
    assert read < big.stat().st_size // 4, f"three no-op reloads read {read >> 20} MiB"
    assert loop_stalls(d) == before, d.log()
