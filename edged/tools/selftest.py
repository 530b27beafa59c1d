"""``edged selftest``: the acceptance check a user runs on a real Jetson, with a paste-able report.

It reports the platform (L4T/JetPack, TensorRT and its CUDA build, CUDA, GPU, board) and the
memory budget, then runs checks, each ending in PASS, FAIL or SKIP (with why):

- **int8**: the demo model through the daemon's own build pipeline (``edged.quantize.pipeline``:
  calibrate on the data → Q/DQ → engine → the model's accuracy gate, with the task metric the
  gate configuration names and the mixed-precision search where the pipeline has one), judged on
  held-out samples it never calibrated on. A fallback to another precision is a FAIL of int8;
- **instances**: several instances of a dynamic-shape engine serving at once (the optimization
  profile rules differ between TensorRT 8.5, 8.6 and 10+), checked against ONNX Runtime;
- **buffers**: the engine run with host buffers mapped into the GPU and with copies: the same
  outputs, and the time of each (mapping is the default on integrated GPUs such as a Jetson's);
- the cold start (a fresh process) and the steady latency, as figures.

The demo model is the config's ``ocr_det`` model (or its first model with an existing file, with
its own calibration data and gate), else ``data/models/ocr_det.onnx`` under the working directory
(judged by text-mask IoU on rendered text pages), else a tiny MLP built on the spot. Everything is
built in a temporary directory: the daemon's cache is left alone. This is a CLI report, so it
writes to ``out``; the daemon never calls it. ``result`` says PASS only when every check that ran
passed and the int8 check ran.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from edged.config import Config, GateConfig, format_size
from edged.errors import EdgedError
from edged.tools.selftest_checks import (
    Check,
    Demo,
    buffers_check,
    cold_start,
    demo_model,
    instances_check,
    int8_check,
    steady,
    synthetic_feeds,
)

__all__ = ["gate_metrics", "judge", "run_selftest", "selftest_qdq", "synthetic_feeds"]
Feed = dict[str, np.ndarray]


class Report:
    def __init__(self, out: TextIO) -> None:
        self.out = out

    def line(self, key: str, value: str) -> None:
        self.out.write(f"{key:<12}: {value}\n")
        self.out.flush()

    def check(self, check: Check) -> Check:
        self.line(check.name, f"{check.detail} -> {check.status}")
        return check


def run_selftest(config_path: str | os.PathLike[str] | None, out: TextIO) -> int:
    """0: every check that ran passed; 1: one failed; 2: the test could not run. Without a
    config path, the default config is read when it exists (as the other commands do)."""
    report = Report(out)
    out.write(f"edged selftest, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n")
    try:
        cfg = _config(config_path)
        usable = _platform(report, cfg)
        with tempfile.TemporaryDirectory(prefix="edged-selftest-") as tmp:
            demo = demo_model(cfg, Path(tmp))
            report.line("model", f"{demo.path.name} ({demo.origin})")
            if not usable:
                for name in ("int8", "instances", "buffers", "cold start"):
                    report.line(name, "NOT RUN: needs TensorRT")
                report.line("result", "ERROR: the TensorRT backend is not usable here")
                return 2
            checks = _exercise(report, demo, Path(tmp))
    except EdgedError as e:  # a config or build problem, explained by its message
        report.line("result", f"ERROR: {e}")
        return 2
    except Exception as e:  # anything else: the traceback belongs in the pasted report
        report.line("result", f"ERROR: {type(e).__name__}: {e}")
        traceback.print_exc(file=out)
        return 2
    failed = [c.name for c in checks if c.status == "FAIL"]
    ran = [c.name for c in checks if c.status != "SKIP"]
    if failed:
        report.line("result", f"FAIL: {', '.join(failed)} ({len(ran) - len(failed)} of {len(ran)} checks passed)")
        return 1
    report.line("result", f"PASS ({len(ran)} checks passed" + _skipped(checks) + ")")
    return 0


def _skipped(checks: Sequence[Check]) -> str:
    skipped = [c.name for c in checks if c.status == "SKIP"]
    return f"; skipped: {', '.join(skipped)}" if skipped else ""


def _config(config_path: str | os.PathLike[str] | None) -> Config:
    from edged import config as config_mod

    if config_path is None and os.path.isfile(config_mod.default_config_path()):
        config_path = config_mod.default_config_path()
    return config_mod.load(config_path) if config_path else config_mod.from_mapping({})


# --- platform --------------------------------------------------------------------------------


def _platform(report: Report, cfg: Config) -> bool:
    from edged.backends.tensorrt import TensorRTBackend
    from edged.backends.tensorrt.fingerprint import TEGRA_RELEASE, parse_tegra_release, read_text

    l4t = parse_tegra_release(read_text(TEGRA_RELEASE))
    where = f"Jetson, L4T {l4t}, JetPack {_jetpack(l4t)}" if l4t else "not a Jetson"
    report.line("platform", f"{where}; {platform.machine()}; Python {platform.python_version()}")
    _memory(report, cfg)
    ok, why = TensorRTBackend.available()
    if not ok:
        report.line("tensorrt", f"NOT USABLE: {why}")
        return False
    from edged.backends.tensorrt.cuda import cuda_versions, shared_device

    fp = TensorRTBackend.fingerprint()
    report.line("tensorrt", fp["tensorrt"] + (f" ({fp['tensorrt_cuda']})" if fp["tensorrt_cuda"] else ""))
    report.line(
        "cuda",
        f"driver API {fp['cuda_driver']}, pycuda built for {cuda_versions()[1]}"
        + (f", kernel driver {fp['driver']}" if fp["driver"] else ""),
    )

    kind = "integrated, host buffers mapped" if shared_device(0).integrated else "discrete, pinned buffers and copies"
    report.line("gpu", f"{fp['gpu']}, compute {fp['compute_capability']}, {fp['sm_count']} SMs, {kind}")
    if fp["board"]:
        report.line("board", fp["board"])
    return True


def _jetpack(l4t: str) -> str:
    """JetPack as jtop or the nvidia-jetpack package reports it, else its major from L4T."""
    try:
        from jtop import jtop  # optional, Jetson only

        with jtop() as jetson:
            found = str(jetson.board["hardware"].get("Jetpack", ""))
        if found:
            return found
    except Exception:  # jtop absent or its service down: ask dpkg
        pass
    try:
        run = subprocess.run(
            ["dpkg-query", "-W", "-f=${Version}", "nvidia-jetpack"], capture_output=True, text=True, timeout=10
        )
        if run.returncode == 0 and run.stdout.strip():
            return run.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return {"35": "5.x", "36": "6.x", "38": "7.x"}.get(l4t.split(".")[0], "unknown")


def _memory(report: Report, cfg: Config) -> None:
    from edged.host.memory import budget_bytes, probe

    try:
        info = probe(cfg.memory.probe)
    except Exception as e:  # the report goes on; the budget line says why it is missing
        report.line("memory", f"no probe works: {e}")
        return
    detail = f" ({info.detail})" if info.detail else ""
    report.line(
        "memory",
        f"{info.source}: {format_size(info.total)} total, "
        f"{format_size(info.available)} available{detail}; budget "
        f"{format_size(budget_bytes(cfg.memory, info))} ({cfg.memory.budget} less "
        f"{cfg.memory.reserve})",
    )


# --- the checks ------------------------------------------------------------------------------


def _exercise(report: Report, demo: Demo, tmp: Path) -> list[Check]:
    checks: list[Check] = []
    started = time.monotonic()
    try:
        int8, entry, held = int8_check(demo, tmp, lambda phase: report.line("building", phase))
    except EdgedError as e:  # the build failed: a verdict on int8, and the other checks still run
        int8, entry, held = Check("int8", "FAIL", f"the build failed: {e}"), None, []
    report.line("data", demo.data_note)
    checks.append(report.check(int8))
    if entry is not None:
        report.line(
            "engine", f"{format_size(entry.artifact.stat().st_size)}, built in {time.monotonic() - started:.0f} s"
        )
    checks.append(report.check(instances_check(tmp)))
    if entry is None:
        checks.append(report.check(Check("buffers", "SKIP", "no engine was built")))
        return checks
    checks.append(report.check(buffers_check(entry.artifact, held)))
    cold = cold_start(entry.artifact, held[0])
    report.line(
        "cold start",
        f"{sum(cold.values()):.0f} ms in a fresh process: import and CUDA init {cold['init_ms']:.0f}, deserialize "
        f"{cold['load_ms']:.0f}, context and buffers {cold['instance_ms']:.0f}, first inference {cold['first_ms']:.0f}",
    )
    report.line("steady", steady(entry.artifact, held))
    return checks


# --- helpers the device tests share ------------------------------------------------------------


def selftest_qdq(source: Path, dest: Path, feeds: Sequence[Feed]) -> Path:
    """The Q/DQ model TensorRT builds INT8 from, made exactly as the daemon's builds make it
    (edged.quantize.qdq), calibrated on ``feeds`` written out as a folder of .npz samples."""
    from edged.backends.onnxruntime import OnnxRuntimeBackend, ort_session
    from edged.config import CalibrationConfig
    from edged.quantize import qdq
    from edged.quantize.calibrate import CalibrationSet

    folder = dest.parent / f"{dest.stem}.calibration"
    folder.mkdir(parents=True, exist_ok=True)
    savez: Any = np.savez  # numpy's stub reads **arrays as its allow_pickle keyword
    for i, feed in enumerate(feeds):
        savez(folder / f"sample{i:04d}.npz", **feed)
    specs = OnnxRuntimeBackend.specs_of(ort_session(str(source)))
    samples = CalibrationSet.load(CalibrationConfig(data=str(folder), max_samples=len(feeds)), specs)
    qdq.quantize_qdq(source, dest, samples)
    return dest


def judge(ref: Sequence[Feed], got: Sequence[Feed], cfg: GateConfig | None = None) -> Any:
    """The daemon's accuracy gate (edged.quantize.gate) on outputs already computed: ``got[i]`` is
    judged against ``ref[i]``."""
    from edged.quantize.gate import evaluate

    index = [{"i": np.array(i)} for i in range(len(ref))]
    return evaluate(lambda f: ref[int(f["i"])], lambda f: got[int(f["i"])], index, cfg or GateConfig())


def gate_metrics(ref: Sequence[Feed], got: Sequence[Feed]) -> dict[str, Any]:
    """The gate's figures (rel_l2, cosine, top1 where outputs are class scores) as a dict."""
    result: dict[str, Any] = judge(ref, got).to_dict()
    return result


if __name__ == "__main__":  # the cold-start child (see selftest_checks.cold_start)
    from edged.tools.selftest_checks import cold_start_child

    sys.stdout.write(json.dumps(cold_start_child(sys.argv[1], sys.argv[2])) + "\n")
