"""``edged selftest``: the acceptance check a user runs on a real Jetson, with a paste-able report.

It reports the platform (L4T/JetPack, TensorRT, CUDA, GPU) and the memory budget, quantizes the
demo model to Q/DQ on synthetic data, builds its INT8 engine through the TensorRT backend (the same
code the daemon's builds run), checks it against ONNX Runtime FP32 with the accuracy gate, and
measures the cold start (load, first inference) and the steady latency. TensorRT is not on the
project's test machines, so this is where the backend meets a real TensorRT; paste the report into
the issue tracker.

The demo model is the config's ``ocr_det`` model (or its first model with an existing file), else
``data/models/ocr_det.onnx`` under the working directory, else a tiny MLP built on the spot.
Engines are built in a temporary directory: the daemon's cache is left alone. This is a CLI
report, so it writes to ``out``; the daemon never calls it.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from edged.backends.base import BuildSpec
from edged.build.gate import GateResult
from edged.config import Config, GateConfig, ModelConfig, format_size
from edged.errors import EdgedError

Feed = dict[str, np.ndarray]
Profiles = dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]
DEMO = Path("data/models/ocr_det.onnx")
CALIBRATION_SAMPLES, EVAL_SAMPLES, STEADY_RUNS = 32, 8, 200


@dataclass
class Demo:
    path: Path
    origin: str
    profiles: Profiles = field(default_factory=dict)
    gate: GateConfig = field(default_factory=GateConfig)


class Report:
    def __init__(self, out: TextIO) -> None:
        self.out = out

    def line(self, key: str, value: str) -> None:
        self.out.write(f"{key:<12}: {value}\n")
        self.out.flush()


def run_selftest(config_path: str | os.PathLike[str] | None, out: TextIO) -> int:
    """0: the INT8 engine passed the gate; 1: it did not; 2: the test could not run. Without a
    config path, the default config is read when it exists (as the other commands do)."""
    report = Report(out)
    out.write(f"edged selftest, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n")
    try:
        cfg = _config(config_path)
        if not _platform(report, cfg):
            return 2
        with tempfile.TemporaryDirectory(prefix="edged-selftest-") as tmp:
            demo = _demo(cfg, Path(tmp))
            passed = _exercise(report, demo, Path(tmp))
    except EdgedError as e:  # a config or build problem, explained by its message
        report.line("result", f"ERROR: {e}")
        return 2
    except Exception as e:  # anything else: the traceback belongs in the pasted report
        report.line("result", f"ERROR: {type(e).__name__}: {e}")
        traceback.print_exc(file=out)
        return 2
    report.line("result", "PASS" if passed else "FAIL (accuracy gate)")
    return 0 if passed else 1


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
        report.line("result", "ERROR: the TensorRT backend is not usable here")
        return False
    fp = TensorRTBackend.fingerprint()
    report.line("tensorrt", fp["tensorrt"])
    report.line(
        "cuda",
        f"driver API {fp['cuda_driver']}, pycuda built for {fp['cuda_build']}"
        + (f", kernel driver {fp['driver']}" if fp["driver"] else ""),
    )
    from edged.backends.tensorrt.cuda import shared_device

    kind = "integrated, host buffers mapped" if shared_device(0).integrated else "discrete, pinned buffers and copies"
    report.line("gpu", f"{fp['gpu']}, compute {fp['compute_capability']}, {fp['sm_count']} SMs, {kind}")
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
    from edged.memory import budget_bytes, probe

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


# --- the demo model ------------------------------------------------------------------------------


def _demo(cfg: Config, tmp: Path) -> Demo:
    models = sorted(cfg.models.items(), key=lambda kv: kv[0] != "ocr_det")
    for name, model in models:
        if Path(model.path).is_file():
            return Demo(Path(model.path), f"config model '{name}'", _profiles(model), model.gate)
    if DEMO.is_file():
        return Demo(DEMO, "demo detector", {"x": ((1, 3, 32, 32), (1, 3, 640, 640), (1, 3, 1280, 1280))})
    from edged.demo import make_tiny_mlp

    path = make_tiny_mlp(tmp / "tiny.onnx")
    return Demo(path, "tiny MLP (no demo model found)", {"x": ((1, 16), (4, 16), (8, 16))})


def _profiles(model: ModelConfig) -> Profiles:
    return {k: (tuple(p.min), tuple(p.opt), tuple(p.max)) for k, p in model.profiles.items()}


def _input_specs(path: Path, profiles: Profiles) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape at the profile's opt, numpy dtype) of each model input."""
    import onnxruntime as ort

    import edged.backends.onnxruntime  # noqa: F401  # turns ONNX Runtime's telemetry off

    specs = []
    for node in ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).get_inputs():
        if node.name in profiles:
            shape = profiles[node.name][1]
        else:
            shape = tuple(d if isinstance(d, int) and d > 0 else 1 for d in node.shape)
        dtype = "float16" if node.type == "tensor(float16)" else "float32"
        specs.append((node.name, tuple(shape), dtype))
    return specs


def synthetic_feeds(specs: Sequence[tuple[str, tuple[int, ...], str]], count: int, seed: int) -> list[Feed]:
    """Image inputs get document-like pictures (a light page with dark strokes, normalised as
    ImageNet models expect); other inputs standard normal values."""
    rng = np.random.default_rng(seed)
    feeds = []
    for _ in range(count):
        feed = {}
        for name, shape, dtype in specs:
            if len(shape) == 4 and shape[1] == 3:
                arr = _page(rng, shape)
            else:
                arr = rng.standard_normal(shape)
            feed[name] = arr.astype(dtype)
        feeds.append(feed)
    return feeds


def _page(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    n, c, h, w = shape
    img = np.empty(shape, np.float32)
    for i in range(n):
        page = np.full((h, w), rng.uniform(0.75, 0.95), np.float32)
        page += np.linspace(0, rng.uniform(-0.1, 0.1), w, dtype=np.float32)[None, :]
        for _ in range(int(rng.integers(5, 25))):
            y, x = int(rng.integers(0, h)), int(rng.integers(0, w))
            length = int(rng.integers(max(1, w // 20), max(2, w // 3)))
            page[y : y + max(2, h // 40), x : x + length] = rng.uniform(0.0, 0.3)
        img[i] = page[None] + rng.normal(0, 0.02, (c, h, w))
    mean = np.array([0.485, 0.456, 0.406], np.float32)[:, None, None]
    std = np.array([0.229, 0.224, 0.225], np.float32)[:, None, None]
    return (img - mean) / std


def quantize_qdq(source: Path, dest: Path, feeds: Sequence[Feed]) -> Path:
    """The Q/DQ model TensorRT builds INT8 from, made exactly as the daemon's builds make it
    (edged.build.quantize), calibrated on ``feeds`` written out as a folder of .npz samples."""
    from edged.backends.onnxruntime import OnnxRuntimeBackend, ort_session
    from edged.build import quantize
    from edged.build.calibrate import CalibrationSet
    from edged.config import CalibrationConfig

    folder = dest.parent / f"{dest.stem}.calibration"
    folder.mkdir(parents=True, exist_ok=True)
    savez: Any = np.savez  # numpy's stub reads **arrays as its allow_pickle keyword
    for i, feed in enumerate(feeds):
        savez(folder / f"sample{i:04d}.npz", **feed)
    specs = OnnxRuntimeBackend.specs_of(ort_session(str(source)))
    samples = CalibrationSet.load(CalibrationConfig(data=str(folder), max_samples=len(feeds)), specs)
    quantize.quantize_qdq(source, dest, samples)
    return dest


# --- build, load, measure, gate ------------------------------------------------------------------


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def _exercise(report: Report, demo: Demo, tmp: Path) -> bool:
    from edged.backends.tensorrt import TensorRTBackend

    specs = _input_specs(demo.path, demo.profiles)
    report.line("model", f"{demo.path.name} ({demo.origin}), inputs " + ", ".join(f"{n}{list(s)}" for n, s, _ in specs))
    calib = synthetic_feeds(specs, CALIBRATION_SAMPLES, seed=1)
    evals = synthetic_feeds(specs, EVAL_SAMPLES, seed=2)
    qdq, secs = _timed(lambda: quantize_qdq(demo.path, tmp / "model.qdq.onnx", calib))
    report.line("quantize", f"Q/DQ in {secs:.1f} s on {len(calib)} synthetic samples")
    engine = tmp / "model.engine"
    spec = BuildSpec(str(qdq), "int8", demo.profiles, {})
    extra, secs = _timed(lambda: TensorRTBackend.build(spec, engine, lambda _p, _f: None))
    typing = "strongly typed" if extra["strongly_typed"] else "flags " + "+".join(extra["builder_flags"])
    report.line("build int8", f"{secs:.1f} s, engine {format_size(engine.stat().st_size)} ({typing})")
    outputs = _run_engine(report, engine, evals)
    return _gate(report, demo, qdq, evals, outputs)


def _run_engine(report: Report, engine: Path, feeds: Sequence[Feed]) -> list[Feed]:
    from edged.backends.tensorrt import TensorRTBackend

    cold = _cold_start(engine, feeds[0])
    report.line(
        "cold start",
        f"{sum(cold.values()):.0f} ms in a fresh process: import and CUDA "
        f"init {cold['init_ms']:.0f}, deserialize {cold['load_ms']:.0f}, context and "
        f"buffers {cold['instance_ms']:.0f}, first inference {cold['first_ms']:.0f}",
    )
    backend = TensorRTBackend(engine)
    backend.load()
    inst = backend.instance()
    outputs = [inst.infer(feed) for feed in feeds]
    times = []
    for i in range(STEADY_RUNS):
        start = time.perf_counter()
        inst.infer(feeds[i % len(feeds)])
        times.append((time.perf_counter() - start) * 1e3)
    report.line(
        "steady",
        f"p50 {np.median(times):.2f} ms, p99 {np.quantile(times, 0.99):.2f} "
        f"ms over {STEADY_RUNS} runs, host copies included; footprint "
        f"{format_size(backend.footprint())}",
    )
    backend.unload()
    return outputs


def _cold_start(engine: Path, feed: Feed) -> dict[str, float]:
    """Time the first inference as the daemon's boot sees it: in a process that has not yet
    imported TensorRT nor touched CUDA."""
    npz = engine.with_suffix(".feed.npz")
    savez: Any = np.savez  # numpy's stub reads **arrays as its allow_pickle keyword
    savez(npz, **feed)
    run = subprocess.run(
        [sys.executable, "-m", "edged.selftest", str(engine), str(npz)], capture_output=True, text=True, timeout=600
    )
    if run.returncode != 0:
        raise RuntimeError(f"cold-start child failed: {run.stderr.strip()[-500:]}")
    times: dict[str, float] = json.loads(run.stdout.strip().splitlines()[-1])
    return times


def cold_start(engine: str, feed_npz: str) -> dict[str, float]:
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


def _ort_outputs(path: Path, feeds: Sequence[Feed]) -> list[Feed]:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return [dict(zip(names, sess.run(names, feed))) for feed in feeds]


def judge(ref: Sequence[Feed], got: Sequence[Feed], cfg: GateConfig | None = None) -> GateResult:
    """The daemon's accuracy gate (edged.build.gate) on outputs already computed: ``got[i]`` is
    judged against ``ref[i]``."""
    from edged.build.gate import evaluate

    index = [{"i": np.array(i)} for i in range(len(ref))]
    return evaluate(lambda f: ref[int(f["i"])], lambda f: got[int(f["i"])], index, cfg or GateConfig())


def gate_metrics(ref: Sequence[Feed], got: Sequence[Feed]) -> dict[str, Any]:
    """The gate's figures (rel_l2, cosine, top1 where outputs are class scores) as a dict."""
    return judge(ref, got).to_dict()


def _gate(report: Report, demo: Demo, qdq: Path, feeds: Sequence[Feed], trt_out: Sequence[Feed]) -> bool:
    fp32 = _ort_outputs(demo.path, feeds)
    g = demo.gate
    result = judge(fp32, trt_out, g)
    text = (
        f"vs ONNX Runtime FP32 on {len(feeds)} held-out samples: rel L2 {result.rel_l2:.4f} "
        f"(<= {g.max_rel_l2}), cosine {result.cosine:.5f} (>= {g.min_cosine})"
    )
    if result.top1 is not None:
        text += f", top-1 {result.top1:.3f} (>= {g.min_top1})"
    report.line("accuracy", text + (" -> PASS" if result.passed else " -> FAIL"))
    q = judge(fp32, _ort_outputs(qdq, feeds), g)
    report.line(
        "reference",
        f"ONNX Runtime on the Q/DQ model: rel L2 {q.rel_l2:.4f}, cosine "
        f"{q.cosine:.5f} (quantization's own error; TensorRT should be close to it)",
    )
    return result.passed


if __name__ == "__main__":  # the cold-start child (see _cold_start)
    sys.stdout.write(json.dumps(cold_start(sys.argv[1], sys.argv[2])) + "\n")
