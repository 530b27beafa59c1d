"""Reload, drain and stop on a real daemon process (the same paths systemd drives)."""

from __future__ import annotations

import os
import shutil
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from edged.tools.demo import make_tiny_mlp
from tests.helpers import DaemonProcess, RequestStream, wait_for

pytestmark = pytest.mark.integration


def ref(model: Path, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_reload_under_load_swaps_with_zero_failures(
    daemon_factory: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    model = make_tiny_mlp(tmp_path / "m.onnx")
    d = daemon_factory({"m": {"path": str(model)}}, extra={"lifecycle": {"watch_files": False}})
    d.start()
    x = np.ones((1, 16), np.float32)
    with d.client() as c:
        old_key = c.status()["models"]["m"]["cache_key"]
    with RequestStream(d) as stream:
        wait_for(lambda: stream.ok > 50, 30, what="requests flowing")
        replacement = make_tiny_mlp(tmp_path / "new.onnx", hidden=48)
        shutil.copyfile(replacement, tmp_path / "m.tmp")
        os.replace(tmp_path / "m.tmp", model)  # replaced atomically, as a deploy would
        assert d.proc is not None
        d.proc.send_signal(signal.SIGHUP)
        with d.client() as c:
            wait_for(lambda: c.status()["models"]["m"]["cache_key"] != old_key, 60, what="the swap")
        before = stream.ok
        wait_for(lambda: stream.ok > before + 50, 30, what="requests after the swap")
    assert stream.failures == []
    with d.client() as c:
        np.testing.assert_allclose(c.infer("m", {"x": x})["probs"], ref(replacement, x), rtol=1e-5)
        assert c.status()["models"]["m"]["state"] == "ready"
    assert "reload done" in d.log()


def test_file_change_triggers_reload(daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    model = make_tiny_mlp(tmp_path / "m.onnx")
    d = daemon_factory({"m": {"path": str(model)}}, extra={"lifecycle": {"watch_interval_s": 0.2}})
    d.start()
    with d.client() as c:
        old_key = c.status()["models"]["m"]["cache_key"]
        make_tiny_mlp(tmp_path / "m2.onnx", hidden=40)
        os.replace(tmp_path / "m2.onnx", model)
        wait_for(lambda: c.status()["models"]["m"]["cache_key"] != old_key, 60, what="reload on file change")
    assert "changed on disk" in d.log()


def test_failed_reload_keeps_serving(daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    model = make_tiny_mlp(tmp_path / "m.onnx")
    d = daemon_factory({"m": {"path": str(model)}}, extra={"lifecycle": {"watch_files": False}})
    d.start()
    d.config.write_text(d.config.read_text() + "\n[models.m.warmup]\nbogus = 1\n")
    assert d.proc is not None
    d.proc.send_signal(signal.SIGHUP)
    with d.client() as c:
        wait_for(lambda: "reload failed" in c.status()["status"], 30, what="reload failure in status")
        assert "models.m.warmup.bogus: unknown key" in c.status()["status"]
        assert c.infer("m", {"x": np.ones((1, 16), np.float32)})["probs"].shape == (1, 4)
        assert c.ready()


def test_sigterm_drains_in_flight_requests(daemon_factory: Callable[..., DaemonProcess], demo_models: Path) -> None:
    d = daemon_factory(
        {
            "m": {
                "path": str(demo_models),
                "backend": "onnxruntime",
                "profiles": {"x": {"min": [1, 3, 32, 32], "opt": [1, 3, 64, 64], "max": [1, 3, 1280, 1280]}},
            }
        }
    )
    d.start()
    frame = np.random.default_rng(0).random((1, 3, 960, 960), dtype=np.float32)
    results: list[object] = []

    def slow() -> None:
        try:
            with d.client() as c:
                results.append(c.infer("m", {"x": frame}))
        except Exception as e:
            results.append(e)

    threads = [threading.Thread(target=slow) for _ in range(3)]
    for t in threads:
        t.start()
    with d.client() as c:
        wait_for(lambda: c.status()["models"]["m"]["queue"] >= 2, 30, 0.001, what="requests in flight")
    assert d.proc is not None
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(60) == 0
    for t in threads:
        t.join(30)
    assert len(results) == 3 and all(isinstance(r, dict) for r in results), results
    assert not d.socket.exists()
    assert "stopped in" in d.log()


@pytest.mark.parametrize("block_ready", [True, False], ids=["build-blocks-ready", "build-in-background"])
def test_sigterm_during_a_build_stops_promptly(
    daemon_factory: Callable[..., DaemonProcess], demo_models: Path, tmp_path: Path, block_ready: bool
) -> None:
    from tests.integration.test_int8 import detector, render_text_images

    data = render_text_images(tmp_path / "pages", 6, size=320)
    model = detector(demo_models, data)
    model["calibration"]["method"] = "entropy"  # a build of tens of seconds
    d = daemon_factory({"det": model}, extra={"build": {"block_ready": block_ready}})
    d.start(wait_ready=False)
    with DaemonProcess.client(d, timeout=5) as c:
        wait_for(lambda: c.status()["builds"], 60, 0.05, what="the build to start")
    assert d.proc is not None
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(20) == 0
    assert ("stopping during start-up" in d.log()) == block_ready
    assert not list((tmp_path / "cache").glob("det-*")), "an interrupted build left an entry"
    assert not d.socket.exists()
