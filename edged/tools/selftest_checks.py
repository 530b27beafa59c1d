"""The checks of ``edged selftest`` (see ``edged.tools.selftest``): the demo model (its data is made
by ``selftest_data``), the int8 build through the daemon's pipeline, several instances of a dynamic
engine, mapped against copied host buffers, cold start and steady latency. Only the TensorRT checks
need TensorRT; choosing the demo and making its data run anywhere (and are unit-tested)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from edged.backends.base import BuildSpec, LoadOptions
from edged.cache.store import Entry
from edged.config import Config, ModelConfig, format_size, from_mapping
from edged.errors import EdgedError
from edged.tools.selftest_data import input_specs, render_pages, synthetic_feeds, write_feeds

__all__ = [
    "Check",
    "Demo",
    "buffers_check",
    "cold_start",
    "demo_model",
    "failed_step",
    "input_specs",
    "instances_check",
    "int8_check",
    "render_pages",
    "steady",
    "synthetic_feeds",
    "write_feeds",
]

Feed = dict[str, np.ndarray]
DEMO = Path("data/models/ocr_det.onnx")
DEMO_PROFILE = {"min": [1, 3, 32, 32], "opt": [1, 3, 640, 640], "max": [1, 3, 1280, 1280]}
# The detector's decision is its text mask: judge it by that (the gate's task metric), not by the
# raw probability map's error. Keys the gate configuration does not know are left out.
DEMO_GATE: dict[str, Any] = {"metric": "mask_iou"}
PAGES, SAMPLES, INSTANCES, STEADY_RUNS = 40, 32, 3, 200
MLP_PROFILE = ((1, 16), (4, 16), (8, 16))


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # PASS | FAIL | SKIP
    detail: str


@dataclass
class Demo:
    name: str
    path: Path
    origin: str
    model: ModelConfig  # as the daemon would build it: backend tensorrt, precision int8
    data_note: str


# --- the demo model and its data ---------------------------------------------------------------


def demo_model(cfg: Config, tmp: Path) -> Demo:
    models = sorted(cfg.models.items(), key=lambda kv: kv[0] != "ocr_det")
    for name, model in models:
        if Path(model.path).is_file():
            if name == "ocr_det" and model.calibration is None:
                # The demo detector with the config's own profiles and TensorRT options (a static
                # profile with dla_core, legacy_calibrator): the demo's data and gate.
                raw = msgspec.to_builtins(model)
                return _detector(Path(model.path), raw["profiles"], raw["tensorrt"], tmp, "config model 'ocr_det'")
            return _configured(name, model, tmp)
    if DEMO.is_file():
        return _detector(DEMO, {"x": DEMO_PROFILE}, {}, tmp, "demo detector")
    from edged.tools.demo import make_tiny_mlp

    path = make_tiny_mlp(tmp / "tiny.onnx")
    folder = write_feeds(tmp / "mlp-data", synthetic_feeds([("x", (4, 16), "float32")], PAGES, seed=1))
    profile = {"x": {"min": list(MLP_PROFILE[0]), "opt": list(MLP_PROFILE[1]), "max": list(MLP_PROFILE[2])}}
    raw = {"path": str(path), "profiles": profile, "calibration": {"data": str(folder)}}
    return Demo("tiny", path, "tiny MLP (no demo model found)", _int8(raw), f"{PAGES} synthetic samples")


def _detector(path: Path, profiles: Any, tensorrt: Any, tmp: Path, origin: str) -> Demo:
    data = render_pages(tmp / "pages", PAGES)
    calibration = {
        "data": str(data),
        "resize": [640, 640],
        "color": "BGR",
        "mean": [0.5] * 3,
        "std": [0.5] * 3,
        "max_samples": PAGES,
    }
    raw = {
        "path": str(path),
        "profiles": profiles,
        "tensorrt": tensorrt,
        "calibration": calibration,
        "gate": _gate(DEMO_GATE),
    }
    return Demo("ocr_det", path, origin, _int8(raw), f"{PAGES} rendered text pages (640x640)")


def _gate(wanted: dict[str, Any]) -> dict[str, Any]:
    from edged.config import GateConfig

    return {k: v for k, v in wanted.items() if k in GateConfig.__struct_fields__}


def _int8(raw: dict[str, Any]) -> ModelConfig:
    model: ModelConfig = from_mapping({"models": {"m": dict(raw, backend="tensorrt", precision="int8")}}).models["m"]
    return model


def _configured(name: str, model: ModelConfig, tmp: Path) -> Demo:
    """A configured model, built as the daemon would at int8; without calibration data of its
    own it gets synthetic samples (and the report says so)."""
    model = msgspec.structs.replace(model, backend="tensorrt", precision="int8")
    if model.calibration is not None:
        return Demo(
            name, Path(model.path), f"config model '{name}'", model, f"its calibration data {model.calibration.data}"
        )
    specs = input_specs(
        Path(model.path), {k: (tuple(p.min), tuple(p.opt), tuple(p.max)) for k, p in model.profiles.items()}
    )
    folder = write_feeds(tmp / f"{name}-data", synthetic_feeds(specs, PAGES, seed=1))
    raw = msgspec.to_builtins(model)
    raw["calibration"] = {"data": str(folder)}
    return Demo(
        name,
        Path(model.path),
        f"config model '{name}'",
        _int8(raw),
        f"{PAGES} synthetic samples (no calibration data configured)",
    )


# --- int8 through the daemon's pipeline --------------------------------------------------------


def int8_check(demo: Demo, tmp: Path, say: Callable[[str], None]) -> tuple[Check, Entry | None, list[Feed]]:
    """Build as the daemon does and report the int8 verdict; returns the entry served (int8, or
    the fallback the gate chose) and held-out feeds for the other checks."""
    from edged.backends.onnxruntime import OnnxRuntimeBackend, ort_session
    from edged.backends.tensorrt import TensorRTBackend
    from edged.cache.store import EngineCache, file_digest
    from edged.quantize.calibrate import CalibrationSet, data_digest
    from edged.quantize.job import job_key, make_job
    from edged.quantize.pipeline import build_precision

    model, cal = demo.model, demo.model.calibration
    assert cal is not None
    cache = EngineCache(tmp / "cache")
    cache.prepare()
    job = make_job(
        demo.name, model, TensorRTBackend, "int8", str(cache.dir), file_digest, lambda m: data_digest(cal.data, cal)
    )
    seen: list[str] = []

    def progress(phase: str, _fraction: float | None) -> None:
        if not seen or seen[-1] != phase:
            seen.append(phase)
            say(phase)

    try:
        entry = build_precision(job, TensorRTBackend, cache, progress)
    except EdgedError as e:  # the check says which step failed: int8's own, or its fallback's
        record = cache.lookup(job.model, job_key(job, TensorRTBackend), TensorRTBackend.artifact_suffix)
        return Check("int8", "FAIL", failed_step(record.manifest if record else None, seen, e)), None, []
    record = cache.lookup(job.model, job_key(job, TensorRTBackend), TensorRTBackend.artifact_suffix)
    manifest = record.manifest if record is not None else entry.manifest
    gate = manifest.get("gate") or {}
    samples = CalibrationSet.load(cal, OnnxRuntimeBackend.specs_of(ort_session(model.path)))
    calib, held = samples.split(model.gate.holdout)
    demo.data_note += f": {len(calib)} calibrate, {len(held)} held out for the gate"
    served = str(entry.manifest.get("precision", "?"))
    passed = bool(gate.get("passed")) and served == "int8"
    detail = f"{_figures(gate)}; {gate.get('reason', 'no gate verdict')}; {_build_note(entry.manifest)}"
    if served != "int8":
        detail += f"; the daemon would serve {served}"
    return Check("int8", "PASS" if passed else "FAIL", detail), entry, list(itertools.islice(held, 8))


def failed_step(int8_record: dict[str, Any] | None, phases: Sequence[str], error: Exception) -> str:
    """Where a build that raised stopped: ``int8_record`` is int8's cached verdict when its gate
    had already judged it (the error then came from the fallback's build), ``phases`` the build's
    progress phases in order."""
    step = f"'{phases[-1]}'" if phases else "its start"
    if int8_record is None or not int8_record.get("fallback"):
        return f"the int8 build failed at {step}: {error}"
    gate = int8_record.get("gate") or {}
    inner = error.__cause__ if isinstance(error.__cause__, Exception) else error
    return (
        f"{_figures(gate)}; int8 built but failed its gate ({gate.get('reason', 'no reason recorded')}); "
        f"the fallback {int8_record['fallback']} then failed at {step}: {inner}"
    )


def _figures(gate: dict[str, Any]) -> str:
    keys = ("mask_iou", "det_f1", "top1", "rel_l2", "cosine")
    shown = [f"{k} {gate[k]:.4g}" for k in keys if isinstance(gate.get(k), (int, float))]
    return ", ".join(shown) or "no figures"


def _build_note(manifest: dict[str, Any]) -> str:
    typing = (
        "strongly typed" if manifest.get("strongly_typed") else "flags " + "+".join(manifest.get("builder_flags", []))
    )
    floats = manifest.get("fp16") or {}
    if floats:
        raised = floats.get("raised_weight_scales")
        typing += f", float parts FP16 ({floats.get('fp16_nodes')} nodes; {floats.get('fp32_nodes')} kept FP32"
        typing += f"; {raised} weight scales raised to FP16's range)" if raised else ")"
    retried = manifest.get("retried")
    if retried:
        typing += f", retried with float parts {str(retried.get('float_parts')).upper()} ({retried.get('because')})"
    if manifest.get("legacy_calibrator"):
        typing += f", legacy calibrator on {manifest.get('calibration_samples')} samples"
    dla = manifest.get("dla_gpu_fallback")
    if dla:
        names = ", ".join(dla["layers"][:5]) + (" ..." if dla["count"] > 5 else "")
        typing += f", DLA core {manifest.get('dla_core')}: {dla['count']} of {dla['of']} layers on the GPU ({names})"
    return typing


# --- instances, buffers, timings -----------------------------------------------------------------


def instances_check(tmp: Path) -> Check:
    """``INSTANCES`` instances of a dynamic-batch engine (the tiny MLP) serving in parallel."""
    import onnxruntime as ort

    from edged.backends.tensorrt import TensorRTBackend
    from edged.tools.demo import make_tiny_mlp

    mlp = make_tiny_mlp(tmp / "instances.onnx")
    engine = tmp / "instances.engine"
    copies = TensorRTBackend.profiles_per_engine(INSTANCES)
    TensorRTBackend.build(
        BuildSpec(str(mlp), "fp32", {"x": MLP_PROFILE}, {"instances": copies}), engine, lambda p, f: None
    )
    sess = ort.InferenceSession(str(mlp), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal((n, 16), dtype=np.float32) for n in (1, 3, 8, 5)]
    refs = [sess.run(None, {"x": x})[0] for x in xs]
    backend = TensorRTBackend(engine, LoadOptions(instances=INSTANCES))
    errors: list[str] = []
    worst = [0.0]
    try:
        backend.load()
        insts = [backend.instance() for _ in range(INSTANCES)]

        def work(i: int) -> None:
            try:
                for _ in range(10):
                    for x, ref in zip(xs, refs):
                        got = insts[i].infer({"x": x})["probs"]
                        worst[0] = max(worst[0], float(np.abs(got - ref).max()))
            except Exception as e:  # reported in the check's detail
                errors.append(f"instance {i + 1}: {e}")

        threads = [threading.Thread(target=work, args=(i,)) for i in range(INSTANCES)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    except Exception as e:
        errors.append(f"{type(e).__name__}: {e}")
    finally:
        backend.unload()
    what = f"{INSTANCES} instances of a dynamic engine (batch 1..8, {copies} profile(s)) in parallel"
    if errors:
        return Check("instances", "FAIL", f"{what}: {errors[0]}")
    if worst[0] > 1e-3:
        return Check("instances", "FAIL", f"{what}: max |diff| {worst[0]:.2g} from ONNX Runtime")
    return Check("instances", "PASS", f"{what}, 40 runs each: max |diff| {worst[0]:.1g} from ONNX Runtime")


def _run_all(engine: Path, feeds: Sequence[Feed], mapped: bool) -> tuple[list[Feed], float]:
    from edged.backends.tensorrt import TensorRTBackend

    backend = TensorRTBackend(engine, LoadOptions(options={"mapped": mapped}))
    backend.load()
    try:
        inst = backend.instance()
        outputs = [inst.infer(f) for f in feeds]
        times = []
        for i in range(40):
            start = time.perf_counter()
            inst.infer(feeds[i % len(feeds)])
            times.append((time.perf_counter() - start) * 1e3)
    finally:
        backend.unload()
    return outputs, float(np.median(times))


def buffers_check(engine: Path, feeds: Sequence[Feed]) -> Check:
    from edged.backends.tensorrt.cuda import shared_device

    device = shared_device(0)
    if not device.can_map:
        return Check("buffers", "SKIP", f"{device.name} cannot map page-locked host memory")
    mapped, t_mapped = _run_all(engine, feeds, True)
    copied, t_copied = _run_all(engine, feeds, False)
    diff = max(float(np.abs(a[k] - b[k]).max()) for a, b in zip(mapped, copied) for k in a)
    default = "mapped" if device.integrated else "copied"
    what = f"mapped p50 {t_mapped:.2f} ms, copied p50 {t_copied:.2f} ms (default here: {default})"
    if diff > 1e-6:
        return Check("buffers", "FAIL", f"{what}; outputs differ by {diff:.2g}")
    return Check("buffers", "PASS", f"{what}; same outputs on {len(feeds)} samples")


def steady(engine: Path, feeds: Sequence[Feed]) -> str:
    from edged.backends.tensorrt import TensorRTBackend

    backend = TensorRTBackend(engine)
    backend.load()
    try:
        inst = backend.instance()
        times = []
        for i in range(STEADY_RUNS):
            start = time.perf_counter()
            inst.infer(feeds[i % len(feeds)])
            times.append((time.perf_counter() - start) * 1e3)
        footprint = backend.footprint()
    finally:
        backend.unload()
    return (
        f"p50 {np.median(times):.2f} ms, p99 {np.quantile(times, 0.99):.2f} ms over {STEADY_RUNS} runs, "
        f"host copies included; footprint {format_size(footprint)}"
    )


def cold_start(engine: Path, feed: Feed) -> dict[str, float]:
    """Time the first inference as the daemon's boot sees it: in a process that has not yet
    imported TensorRT nor touched CUDA."""
    npz = engine.with_suffix(".feed.npz")
    savez: Any = np.savez  # numpy's stub reads **arrays as its allow_pickle keyword
    savez(npz, **feed)
    run = subprocess.run(
        [sys.executable, "-m", "edged.tools.selftest", str(engine), str(npz)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if run.returncode != 0:
        raise RuntimeError(f"cold-start child failed: {run.stderr.strip()[-500:]}")
    times: dict[str, float] = json.loads(run.stdout.strip().splitlines()[-1])
    return times


def cold_start_child(engine: str, feed_npz: str) -> dict[str, float]:
    """The cold-start child's work: import, CUDA init, load, instance, first inference."""
    marks = [time.perf_counter()]
    from edged.backends.tensorrt import TensorRTBackend

    ok, why = TensorRTBackend.available()  # imports tensorrt and initialises CUDA
    if not ok:
        raise RuntimeError(why)
    marks.append(time.perf_counter())
    backend = TensorRTBackend(Path(engine))
    backend.load()
    marks.append(time.perf_counter())
    inst = backend.instance()
    marks.append(time.perf_counter())
    with np.load(feed_npz, allow_pickle=False) as z:
        feed = {k: z[k] for k in z.files}
    marks.append(time.perf_counter())
    inst.infer(feed)
    marks.append(time.perf_counter())
    backend.unload()
    ms = [(b - a) * 1e3 for a, b in itertools.pairwise(marks)]
    return {"init_ms": ms[0], "load_ms": ms[1], "instance_ms": ms[2], "first_ms": ms[4]}
