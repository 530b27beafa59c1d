"""INT8 built on the device: real calibration on images the test renders, the Q/DQ model, the
accuracy gate deciding the precision, isolated builds, and cache invalidation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers import DaemonProcess, wait_for

pytestmark = pytest.mark.integration

WORDS = ["edged", "jetson", "int8", "tensor", "camera", "socket", "engine", "warm"]


def render_text_images(folder: Path, count: int, size: int = 160) -> Path:
    """Document-like calibration images: dark words on light paper, like the detector's input."""
    from PIL import Image, ImageDraw

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(5)
    for i in range(count):
        img = Image.new("RGB", (size, size), tuple(int(v) for v in rng.integers(200, 256, 3)))
        draw = ImageDraw.Draw(img)
        for line in range(5):
            words = " ".join(rng.choice(WORDS, 2))
            draw.text((int(rng.integers(2, 30)), 8 + line * 30), words, fill=(20, 20, 20))
        img.save(folder / f"page{i:02d}.png")
    return folder


def detector(path: Path, data: Path, gate: dict[str, object] | None = None) -> dict[str, Any]:
    return {
        "path": str(path),
        "backend": "onnxruntime",
        "precision": "int8",
        "profiles": {"x": {"min": [1, 3, 32, 32], "opt": [1, 3, 160, 160], "max": [1, 3, 640, 640]}},
        "calibration": {
            "data": str(data),
            "method": "minmax",
            "resize": [160, 160],
            "mean": [0.485, 0.456, 0.406],
            "std": [0.229, 0.224, 0.225],
        },
        "gate": gate or {},
    }


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return render_text_images(tmp_path_factory.mktemp("pages") / "pages", 10)


def status(d: DaemonProcess) -> dict[str, Any]:
    with d.client() as c:
        return c.status()["models"]["det"]


def test_gate_pass_serves_int8_and_the_qdq_model_is_shared(
    daemon_factory: Callable[..., DaemonProcess], demo_models: Path, pages: Path, tmp_path: Path
) -> None:
    # Thresholds for a segmentation map (the defaults suit classifiers); see the INT8 docs.
    d = daemon_factory({"det": detector(demo_models, pages, {"max_rel_l2": 0.5, "min_cosine": 0.9})})
    d.start(timeout=180)
    st = status(d)
    assert st["precision"] == "int8" and st["state"] == "ready", st
    gate = st["gate"]
    assert gate["passed"] is True and gate["samples"] >= 1 and 0.9 <= gate["cosine"] <= 1.0
    qdq = list((tmp_path / "cache" / "qdq").glob("det-*.onnx"))
    assert len(qdq) == 1
    manifest = json.loads(next((tmp_path / "cache").glob("det-*.json")).read_text())
    assert manifest["precision"] == "int8" and manifest["qdq_model"] == qdq[0].name
    frame = np.random.default_rng(0).random((1, 3, 160, 160), dtype=np.float32)
    with d.client() as c:
        assert c.infer("det", {"x": frame})["sigmoid_0.tmp_0"].shape == (1, 1, 160, 160)


def test_gate_fail_falls_back_to_fp32_and_says_why(
    daemon_factory: Callable[..., DaemonProcess], demo_models: Path, pages: Path, tmp_path: Path
) -> None:
    d = daemon_factory({"det": detector(demo_models, pages, {"max_rel_l2": 0.001, "min_cosine": 0.99999})})
    d.start(timeout=180)
    st = status(d)
    assert st["precision"] == "fp32" and st["requested_precision"] == "int8", st
    assert "int8 failed the accuracy gate" in st["precision_reason"]
    assert st["gate"]["passed"] is False and st["gate"]["rel_l2"] > 0.001
    assert "failed the accuracy gate" in d.log()  # a warning, never silent
    assert d.stop() == 0
    # The next boot goes straight to the fallback: no calibration, no build, same verdict.
    d.log_path.write_text("")
    d.start(timeout=60)
    assert "building" not in d.log()
    assert status(d)["precision"] == "fp32"
    # edged plan shows it too.
    out = subprocess.run(
        [sys.executable, "-m", "edged", "plan", "--config", str(d.config), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    (model,) = json.loads(out.stdout)["models"]
    assert model["precision"] == "fp32" and "accuracy gate" in model["reason"]


def test_calibration_data_change_rebuilds_and_build_check(
    daemon_factory: Callable[..., DaemonProcess], demo_models: Path, tmp_path: Path
) -> None:
    data = render_text_images(tmp_path / "data", 4, size=96)
    d = daemon_factory({"det": detector(demo_models, data, {"max_rel_l2": 0.9, "min_cosine": 0.5})})
    build = [sys.executable, "-m", "edged", "build", "--config", str(d.config)]
    assert subprocess.run([*build, "--check"], capture_output=True).returncode == 1
    done = subprocess.run(build, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "det" in done.stdout and "int8" in done.stdout and "pass" in done.stdout
    assert subprocess.run([*build, "--check"], capture_output=True).returncode == 0
    render_text_images(tmp_path / "more", 1, size=96)
    os.replace(tmp_path / "more" / "page00.png", data / "extra.png")
    check = subprocess.run([*build, "--check"], capture_output=True, text=True)
    assert check.returncode == 1 and "det: needs a build" in check.stdout


def test_killed_build_fails_only_its_model(
    daemon_factory: Callable[..., DaemonProcess], demo_models: Path, model_dir: Path, tmp_path: Path
) -> None:
    """A build child killed with SIGKILL (as the OOM killer would) while the daemon serves another
    model: the reload fails with the reason, the other model keeps serving, nothing partial stays."""
    data = render_text_images(tmp_path / "data", 6, size=320)
    d = daemon_factory({"tiny": {"path": str(model_dir / "tiny.onnx")}}, extra={"lifecycle": {"watch_files": False}})
    d.start()
    cfg = d.config.read_text()
    model = detector(demo_models, data)
    model["calibration"]["method"] = "entropy"  # slow enough to be caught
    from tests.helpers import toml_value

    extra = ["[models.det]"] + [f"{k} = {toml_value(v)}" for k, v in model.items() if not isinstance(v, dict)]
    extra += ["[models.det.calibration]"] + [f"{k} = {toml_value(v)}" for k, v in model["calibration"].items()]
    d.config.write_text(cfg + "\n" + "\n".join(extra) + "\n")
    assert d.proc is not None
    d.proc.send_signal(signal.SIGHUP)
    pid = d.proc.pid
    child = wait_for(lambda: _build_child(pid), 60, 0.01, "the build child")
    os.kill(child, signal.SIGKILL)
    with d.client() as c:
        wait_for(lambda: "reload failed" in c.status()["status"], 60, what="the failed reload")
        assert "killed" in c.status()["status"]
        assert c.infer("tiny", {"x": np.ones((1, 16), np.float32)})["probs"].shape == (1, 4)
    cache = tmp_path / "cache"
    assert not list(cache.glob("det-*")), "a killed build left an entry"
    assert d.stop() == 0


def _build_child(parent: int) -> int | None:
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and b"edged.quantize.worker" in cmdline:
            return int(pid)
    return None


def test_build_waits_for_memory_headroom_then_fails_with_what_it_needs(
    daemon_factory: Callable[..., DaemonProcess], model_dir: Path
) -> None:
    d = daemon_factory(
        {"tiny": {"path": str(model_dir / "tiny.onnx")}},
        extra={"build": {"headroom": "100TiB", "wait_for_memory_s": 0}},
    )
    d.start(wait_ready=False)  # not ready: its only boot model failed, and 0 models ready is not ready
    with d.client() as c:
        wait_for(lambda: c.status()["models"]["tiny"]["state"] == "failed", 60, what="the build to give up")
        st = c.status()["models"]["tiny"]
        assert not c.ready()
    assert st["state"] == "failed"
    assert "needs 102400.0 GiB free (build.headroom)" in st["reason"] and "available" in st["reason"]


def test_failed_all_int8_searches_mixed_precision_once(
    daemon_factory: Callable[..., DaemonProcess], demo_models: Path, pages: Path, tmp_path: Path
) -> None:
    """All-INT8 misses a tight gate: the build searches for nodes to keep in float, serves int8
    (mixed) with the trials recorded, and the next boot reuses the result without searching."""
    gate = {"metric": "rel_l2", "max_rel_l2": 0.2, "max_trials": 8}
    d = daemon_factory({"det": detector(demo_models, pages, gate)})
    d.start(timeout=300)
    st = status(d)
    assert st["precision"] == "int8" and st["state"] == "ready", st
    found = st["gate"]
    assert found["passed"] is True and found["rel_l2"] <= 0.2, found
    search = found["search"]
    assert search["passed"] and search["excluded"] and len(search["trials"]) <= 8
    assert search["trials"][0]["float_nodes"] == 0 and not search["trials"][0]["passed"]
    assert search["trials"][0]["rel_l2"] > 0.2  # all-INT8 really failed
    assert 0.0 < search["int8_mac_fraction"] < 1.0
    manifest = json.loads(next((tmp_path / "cache").glob("det-*.json")).read_text())
    assert manifest["int8_float_nodes"] == search["excluded"] and manifest["qdq_model"].endswith("-mixed.onnx")
    assert "built int8 (mixed)" in d.log() and "MACs int8" in d.log()
    frame = np.random.default_rng(0).random((1, 3, 160, 160), dtype=np.float32)
    with d.client() as c:
        assert c.infer("det", {"x": frame})["sigmoid_0.tmp_0"].shape == (1, 1, 160, 160)
    assert d.stop() == 0
    d.log_path.write_text("")
    d.start(timeout=60)
    assert "building" not in d.log() and "mixed precision" not in d.log()
    again = status(d)
    assert again["precision"] == "int8" and again["gate"]["search"]["excluded"] == search["excluded"]
    out = subprocess.run(
        [sys.executable, "-m", "edged", "build", "--config", str(d.config)], capture_output=True, text=True
    )
    assert out.returncode == 0 and "int8 (mixed)" in out.stdout, out.stdout
    for cmd in (["plan"], ["status", "--socket", str(d.socket)]):
        shown = subprocess.run(
            [sys.executable, "-m", "edged", *cmd, "--config", str(d.config)], capture_output=True, text=True
        )
        assert shown.returncode == 0 and "int8 (mixed)" in shown.stdout, (cmd, shown.stdout, shown.stderr)
