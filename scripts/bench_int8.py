#!/usr/bin/env python3
"""INT8 (Q/DQ) against FP32 on the ONNX Runtime CPU backend: latency and the accuracy gate.

Two models: the demo PP-OCRv4 text detector, calibrated on synthetic document images (text drawn
with Pillow, fed through the image preprocessing of ``[models.NAME.calibration]``), and a small
digits-like CNN with fixed random weights, calibrated on rendered digits saved as .npy. Each goes
through the daemon's own pieces: CalibrationSet → quantize_qdq → OnnxRuntimeBackend.build/load →
gate.evaluate on the held-out part, then FP32 and INT8 run interleaved on the same input.

    python scripts/bench_int8.py --out int8.json [--methods minmax,percentile,entropy]

Target (issue 3): INT8 at least 1.3x faster, with top-1 agreement >= 99% or relative error <= 1%.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from PIL import Image, ImageDraw, ImageFont

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edged.backends.base import BuildSpec, Instance, LoadOptions
from edged.backends.onnxruntime import OnnxRuntimeBackend
from edged.build.calibrate import CalibrationSet
from edged.build.gate import GateResult, evaluate
from edged.build.quantize import quantize_qdq
from edged.config import CalibrationConfig, GateConfig
from edged.demo import extract_detector

WORDS = (
    "edged",
    "jetson",
    "inference",
    "daemon",
    "int8",
    "calibration",
    "tensor",
    "engine",
    "cache",
    "socket",
    "mqtt",
    "systemd",
    "model",
    "quantize",
    "gate",
    "latency",
    "orin",
    "xavier",
    "nano",
    "camera",
    "frame",
)


@dataclass
class Case:
    name: str
    model: Path
    data: Path
    calibration: CalibrationConfig
    bench_feed: dict[str, np.ndarray]


# --- data --------------------------------------------------------------------------------------


def _font(size: int) -> Any:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1 has one bitmap size
        return ImageFont.load_default()


def text_image(rng: np.random.Generator, size: int) -> Image.Image:
    """A light page with a few lines of dark text, what the detector is for."""
    img = Image.new("RGB", (size, size), tuple(int(v) for v in rng.integers(190, 256, 3)))
    draw = ImageDraw.Draw(img)
    y = int(rng.integers(4, 24))
    while y < size - 24:
        height = int(rng.integers(14, 34))
        words = " ".join(rng.choice(WORDS, int(rng.integers(1, 6))))
        ink = tuple(int(v) for v in rng.integers(0, 90, 3))
        draw.text((int(rng.integers(4, size // 4)), y), words, fill=ink, font=_font(height))
        y += height + int(rng.integers(6, 40))
    return img


def digit_tensor(rng: np.random.Generator) -> np.ndarray:
    """A 28x28 rendered digit, shifted and noisy, normalized as MNIST models expect."""
    img = Image.new("L", (28, 28), 0)
    ImageDraw.Draw(img).text(
        (int(rng.integers(4, 12)), int(rng.integers(0, 6))), str(int(rng.integers(0, 10))), fill=255, font=_font(20)
    )
    x = np.asarray(img, np.float32) / 255.0 + rng.normal(0, 0.05, (28, 28)).astype(np.float32)
    return ((x - 0.1307) / 0.3081)[np.newaxis]  # (1, 28, 28): a sample without batch dim


def detector_case(work: Path, det: Path, n: int, size: int) -> Case:
    data = work / "det_images"
    data.mkdir(exist_ok=True)
    rng = np.random.default_rng(2024)
    for i in range(n):
        text_image(rng, size).save(data / f"page{i:03d}.png")
    cal = CalibrationConfig(data=str(data), resize=[size, size], color="BGR", mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5])
    return Case("ppocr_det", det, data, cal, {})


def digits_cnn(path: Path) -> Path:
    """conv(1→32) relu pool, conv(32→64) relu pool, conv(64→128) relu, GAP, Gemm(128→10)."""
    rng = np.random.default_rng(7)
    chans, nodes, inits, x = (1, 32, 64, 128), [], [], "x"
    for i in range(3):
        fan_in = chans[i] * 9
        inits += [
            numpy_helper.from_array(
                (rng.standard_normal((chans[i + 1], chans[i], 3, 3)) * np.sqrt(2 / fan_in)).astype(np.float32), f"w{i}"
            ),
            numpy_helper.from_array((rng.standard_normal(chans[i + 1]) * 0.05).astype(np.float32), f"b{i}"),
        ]
        nodes += [
            helper.make_node("Conv", [x, f"w{i}", f"b{i}"], [f"c{i}"], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", [f"c{i}"], [f"r{i}"]),
        ]
        x = f"r{i}"
        if i < 2:
            nodes.append(helper.make_node("MaxPool", [x], [f"p{i}"], kernel_shape=[2, 2], strides=[2, 2]))
            x = f"p{i}"
    inits += [
        numpy_helper.from_array((rng.standard_normal((10, 128)) * 0.25).astype(np.float32), "fw"),
        numpy_helper.from_array(np.zeros(10, np.float32), "fb"),
    ]
    nodes += [
        helper.make_node("GlobalAveragePool", [x], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
        helper.make_node("Gemm", ["f", "fw", "fb"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "digits",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 28, 28])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def cnn_case(work: Path, n: int, batch: int) -> Case:
    data = work / "digits"
    data.mkdir(exist_ok=True)
    rng = np.random.default_rng(99)
    for i in range(n):
        np.save(data / f"digit{i:03d}.npy", digit_tensor(rng))
    feed = {"x": np.stack([digit_tensor(rng) for _ in range(batch)])}
    return Case("digits_cnn", digits_cnn(work / "digits.onnx"), data, CalibrationConfig(data=str(data)), feed)


# --- measuring ------------------------------------------------------------------------------------


def load(model: Path, dest: Path, threads: int) -> tuple[OnnxRuntimeBackend, Instance]:
    OnnxRuntimeBackend.build(BuildSpec(source=str(model), precision="fp32"), dest, lambda phase, frac: None)
    backend = OnnxRuntimeBackend(dest, LoadOptions(threads=threads))
    backend.load()
    return backend, backend.instance()


def latency(runs: dict[str, Callable[[], Any]], iterations: int) -> dict[str, list[float]]:
    """Interleaved, so a noisy neighbour slows both alike."""
    for run in runs.values():
        for _ in range(3):
            run()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(iterations):
        for k, run in runs.items():
            t0 = time.perf_counter()
            run()
            times[k].append((time.perf_counter() - t0) * 1e3)
    return times


def mask_iou(ref: Callable[..., Any], cand: Callable[..., Any], feeds: list[Any]) -> float:
    """The detector's own decision: pixels above its 0.3 threshold."""
    inter = union = 0
    for feed in feeds:
        a = next(iter(ref(feed).values())) > 0.3
        b = next(iter(cand(feed).values())) > 0.3
        inter += int(np.count_nonzero(a & b))
        union += int(np.count_nonzero(a | b))
    return inter / union if union else 1.0


def run_case(case: Case, method: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    fp32, ref = load(case.model, work / f"{case.name}.fp32.onnx", args.threads)
    samples = CalibrationSet.load(case.calibration, fp32.inputs)
    calib, held = samples.split(args.holdout)
    qdq = work / f"{case.name}.{method}.qdq.onnx"
    summary = quantize_qdq(
        case.model, qdq, calib, method, args.percentile, ranges_cache=work / f"{case.name}.{method}.ranges.json"
    )
    _, cand = load(qdq, work / f"{case.name}.{method}.int8.onnx", args.threads)
    gate: GateResult = evaluate(ref.infer, cand.infer, held, GateConfig())
    feed = case.bench_feed or next(iter(held))
    times = latency({"fp32": lambda: ref.infer(feed), "int8": lambda: cand.infer(feed)}, args.iterations)
    fp32_ms, int8_ms = statistics.median(times["fp32"]), statistics.median(times["int8"])
    speedup = fp32_ms / int8_ms
    accurate = (gate.top1 is not None and gate.top1 >= 0.99) or gate.rel_l2 <= 0.01
    result = {
        "model": case.name,
        "method": method,
        "input": {k: list(v.shape) for k, v in feed.items()},
        "calibration_samples": len(calib),
        "holdout_samples": len(held),
        "quantize": summary,
        "gate": gate.to_dict(),
        "fp32_ms": {"median": fp32_ms, "p90": float(np.percentile(times["fp32"], 90))},
        "int8_ms": {"median": int8_ms, "p90": float(np.percentile(times["int8"], 90))},
        "speedup": speedup,
        "target_met": bool(speedup >= 1.3 and accurate),
    }
    if case.name == "ppocr_det":
        result["mask_iou"] = mask_iou(ref.infer, cand.infer, list(held))
    return result


# --- output ---------------------------------------------------------------------------------------


def table(results: list[dict[str, Any]]) -> str:
    head = (
        f"{'model':<11} {'method':<10} {'fp32 ms':>8} {'int8 ms':>8} {'speedup':>7} "
        f"{'rel L2':>8} {'cosine':>8} {'top-1':>7} {'IoU':>6} {'gate':>5} {'target':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        g = r["gate"]
        top1 = f"{g['top1']:.2%}" if g["top1"] is not None else "-"
        iou = f"{r['mask_iou']:.3f}" if "mask_iou" in r else "-"
        lines.append(
            f"{r['model']:<11} {r['method']:<10} {r['fp32_ms']['median']:8.2f} "
            f"{r['int8_ms']['median']:8.2f} {r['speedup']:6.2f}x {g['rel_l2']:8.4f} "
            f"{g['cosine']:8.5f} {top1:>7} {iou:>6} {'pass' if g['passed'] else 'fail':>5} "
            f"{'yes' if r['target_met'] else 'no':>6}"
        )
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="write the results here (JSON)")
    p.add_argument("--det-model", type=Path, help="PP-OCRv4 detector (else from the wheel)")
    p.add_argument("--wheel-dir", type=Path, default=Path("/tmp/rwheel"))
    p.add_argument("--models", default="ppocr_det,digits_cnn")
    p.add_argument("--methods", default="minmax")
    p.add_argument("--percentile", type=float, default=99.999)
    p.add_argument("--images", type=int, default=32, help="detector calibration images")
    p.add_argument("--size", type=int, default=640, help="detector input side (multiple of 32)")
    p.add_argument("--digits", type=int, default=200, help="CNN calibration samples")
    p.add_argument("--batch", type=int, default=32, help="CNN batch for the latency run")
    p.add_argument("--holdout", type=float, default=0.25)
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--threads", type=int, default=cores)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-int8-") as tmp:
        work = Path(tmp)
        cases = []
        if "ppocr_det" in args.models:
            det = args.det_model or extract_detector(work / "ocr_det.onnx", args.wheel_dir)
            cases.append(detector_case(work, det, args.images, args.size))
        if "digits_cnn" in args.models:
            cases.append(cnn_case(work, args.digits, args.batch))
        for case in cases:
            for method in args.methods.split(","):
                print(f"{case.name} {method} ...", file=sys.stderr, flush=True)
                results.append(run_case(case, method, args, work))
    report = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": args.threads,
            "onnxruntime": ort.__version__,
            "python": platform.python_version(),
        },
        "settings": {k: str(v) for k, v in vars(args).items()},
        "results": results,
    }
    args.out.write_text(json.dumps(report, indent=2))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
