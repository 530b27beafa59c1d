"""FP32 ONNX → Q/DQ ONNX: the one INT8 model every backend builds from.

ONNX Runtime's static quantization writes the model; the options below give it the form
TensorRT's explicit quantization accepts (TensorRT 8.5 through 11, the versions JetPack ships):

* QDQ format, int8 activations and weights, every zero point 0: TensorRT quantizes
  symmetrically and rejects non-zero zero points (``ActivationSymmetric``, ``WeightSymmetric``).
* Weights stay FP32 behind their own QuantizeLinear → DequantizeLinear pair
  (``AddQDQPairToWeight``): TensorRT 8.x only accepts FP32 weights in a Q/DQ network and
  quantizes them itself with the given scale; 10.x accepts both forms.
* Weights per channel on the output-channel axis: Conv 0, ConvTranspose 1 (its weight is
  [C_in, C_out/g, ...]), MatMul 1 ([K, N]); Gemm follows ``transB`` (ORT's own rule).
  Per-channel Q/DQ needs the ``axis`` attribute, so models below opset 13 are converted first.
* Biases stay FP32 (``QuantizeBias`` off): TensorRT fuses a float bias and has no INT32
  DequantizeLinear to take a quantized one.
* One Q/DQ pair per consumer (``DedicatedQDQPair``): TensorRT fuses a DQ into the one layer that
  follows it; a shared DQ blocks the fusion.
* Relu/Clip are kept (``QDQKeepRemovableActivations``): folding them into the quantized range is
  only exact for asymmetric quantization.

By default the weighted ops and the pooling ops between them are quantized (TensorRT's own
advice is to quantize the inputs of weighted layers first). Quantizing every op ORT can
(``op_types=None``) made ONNX Runtime on the CPU slower on the PP-OCR detector: each elementwise
op it has no int8 kernel for runs between a DequantizeLinear and a QuantizeLinear.

The activation ranges are computed here, in chunks (a histogram calibrator otherwise holds every
intermediate tensor of every sample at once), and kept as ORT's calibration-cache JSON with an
``edged`` block naming what they were computed from; a rebuild for another backend reuses them
through ``quantize_static(calibration_cache_path=...)``.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import io
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort
from onnx import version_converter
from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
from onnxruntime.quantization.calibrate import TensorsData, create_calibrator
from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry
from onnxruntime.quantization.shape_inference import quant_pre_process

from edged.backends.base import Progress
from edged.cache.store import atomic_write, file_digest
from edged.errors import BuildError
from edged.quantize.calibrate import CalibrationSet
from edged.quantize.qdq_graph import MIN_OPSET, check_qdq, float_graph_outputs, name_nodes, qdq_nodes_summary

log = logging.getLogger(__name__)

DEFAULT_OP_TYPES: tuple[str, ...] = (
    "Conv",
    "ConvTranspose",
    "Gemm",
    "MatMul",
    "MaxPool",
    "AveragePool",
    "GlobalAveragePool",
)
RANGES_FORMAT = 1
METHODS = {
    "minmax": CalibrationMethod.MinMax,
    "entropy": CalibrationMethod.Entropy,
    "percentile": CalibrationMethod.Percentile,
}
# Files per calibrator call for the histogram methods: they keep every intermediate tensor of a
# call in memory (hundreds of MB per 640x640 image for a detector).
HISTOGRAM_CHUNK = 4

QDQ_OPTIONS: dict[str, Any] = {
    "ActivationSymmetric": True,
    "WeightSymmetric": True,
    "AddQDQPairToWeight": True,
    "QuantizeBias": False,
    "DedicatedQDQPair": True,
    "QDQKeepRemovableActivations": True,
    "QDQOpTypePerChannelSupportToAxis": {"Conv": 0, "ConvTranspose": 1, "MatMul": 1},
}

# ORT 1.32 takes precomputed ranges; older wheels (the ones built for JetPack, the last for Python
# 3.10) would calibrate inside quantize_static with their own reading of the options (there a
# percentile calibration came out as minmax). On those edged still computes the ranges itself,
# with the same calibrator and options, and hands them to ORT's QDQ quantizer directly; only the
# on-disk ranges cache needs ORT's save_tensors_data, so there the ranges are not reused.
_ORT_TAKES_RANGES = "calibration_cache_path" in inspect.signature(quantize_static).parameters


def _calibrator_options(method: str, percentile: float) -> dict[str, Any]:
    if method == "entropy":
        # ORT's defaults (128 bins into 128 quantized bins) leave the KL search a single
        # candidate, the full range: the same as minmax. TensorRT's entropy calibrator uses
        # 2048 bins into 128.
        return {"num_bins": 2048, "num_quantized_bins": 128}
    if method == "percentile":
        return {"num_bins": 2048, "percentile": percentile, "symmetric": True}
    return {}


def _all_op_types() -> list[str]:
    return sorted(set(QLinearOpsRegistry) | set(QDQRegistry))


def ranges_key(
    model_digest: str,
    data_digest: str,
    method: str,
    percentile: float,
    op_types: Sequence[str] | None = DEFAULT_OP_TYPES,
) -> str:
    """What the activation ranges depend on: the FP32 model, the calibration part of the data,
    the method (and percentile), the quantized ops and the ORT version (its pre-processing
    names the tensors). Not the nodes kept in float: the ranges of every tensor the op types
    touch are computed either way, so the trials of a mixed-precision search share them."""
    fields = {
        "format": RANGES_FORMAT,
        "model": model_digest,
        "data": data_digest,
        "method": method,
        "percentile": percentile if method == "percentile" else None,
        "op_types": sorted(op_types) if op_types is not None else None,
        "ort": ort.__version__,
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


# --- steps -----------------------------------------------------------------------------------------


def _prepare(fp32_model: Path, workdir: Path) -> tuple[Path, int]:
    """Opset >= 13 (per-channel axis) and ORT's recommended pre-processing: shape inference and
    the basic (ONNX-only, device-independent) optimizations that fold BatchNormalization into
    Conv and constants into initializers, so weights are initializers that can be quantized."""
    try:
        model = onnx.load(str(fp32_model))
    except Exception as e:  # onnx raises DecodeError and friends
        raise BuildError(f"{fp32_model}: cannot load ONNX model: {e}") from None
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < MIN_OPSET:
        log.info("%s: converting opset %d to %d for per-channel Q/DQ", fp32_model.name, opset, MIN_OPSET)
        try:
            model = version_converter.convert_version(model, MIN_OPSET)
        except Exception as e:
            raise BuildError(f"{fp32_model}: cannot convert opset {opset} to {MIN_OPSET}: {e}") from None
        opset = MIN_OPSET
    converted, prepared = workdir / "opset.onnx", workdir / "prepared.onnx"
    onnx.save(model, str(converted))  # quant_pre_process takes a path in every ORT version
    # Symbolic shape inference needs sympy and mostly helps transformers; ONNX shape inference
    # and the optimizer still run without it.
    try:
        import sympy  # noqa: F401

        symbolic = True
    except ImportError:
        symbolic = False
    quant_pre_process(str(converted), str(prepared), skip_symbolic_shape=not symbolic)
    name_nodes(prepared)
    return prepared, opset


def prepare(fp32_model: Path, workdir: Path) -> Path:
    """The model as the quantizer reads it (its node names are what ``nodes_to_exclude`` takes)."""
    return _prepare(fp32_model, workdir)[0]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """ORT's calibrators print() their progress; the daemon's output is its log."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        yield
    if buf.getvalue().strip():
        log.debug("onnxruntime: %s", buf.getvalue().strip())


def _compute_ranges(
    prepared: Path,
    samples: CalibrationSet,
    method: str,
    percentile: float,
    op_types: list[str],
    workdir: Path,
    progress: Progress,
) -> TensorsData:
    calibrator = create_calibrator(
        prepared,
        op_types,
        augmented_model_path=str(workdir / "augmented.onnx"),
        calibrate_method=METHODS[method],
        extra_options=_calibrator_options(method, percentile),
    )
    reader = samples.reader()
    chunk = len(samples) if method == "minmax" else HISTOGRAM_CHUNK
    with _quiet():
        for start in range(0, len(samples), chunk):
            progress("calibrating", start / len(samples))
            reader.set_range(start, start + chunk)
            calibrator.collect_data(reader)
        progress("calibrating", 1.0)
        ranges = calibrator.compute_data()
    if not isinstance(ranges, TensorsData):
        raise BuildError(f"onnxruntime calibrator returned {type(ranges).__name__}")
    return ranges


def _cached_ranges(path: Path, key: str) -> bool:
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        return False
    except (OSError, ValueError) as e:
        log.warning("ranges cache %s unreadable (%s); recalibrating", path, e)
        return False
    edged = data.get("edged") if isinstance(data, dict) else None
    if not isinstance(edged, dict) or edged.get("key") != key:
        log.info("ranges cache %s is for other inputs; recalibrating", path.name)
        return False
    return True


def _write_ranges(ranges: TensorsData, path: Path, key: str, info: dict[str, Any]) -> None:
    """ORT's own cache format (so quantize_static reads it) plus an ``edged`` block."""
    # Imported here: onnxruntime 1.23 (the last wheels for Python 3.10, JetPack 6) has no
    # save_tensors_data, and there this is never called (_ORT_TAKES_RANGES is False).
    from onnxruntime.quantization.calibrate import save_tensors_data

    tmp = path.parent / f".tmp-{os.getpid()}-{path.name}"
    save_tensors_data(ranges, tmp)
    try:
        data = json.loads(tmp.read_bytes())
    finally:
        tmp.unlink(missing_ok=True)
    data["edged"] = dict(info, key=key, format=RANGES_FORMAT)
    atomic_write(path, json.dumps(data).encode())


# --- the entry point -------------------------------------------------------------------------------


def quantize_qdq(
    fp32_model: Path,
    out: Path,
    samples: CalibrationSet,
    method: str = "minmax",
    percentile: float = 99.999,
    ranges_cache: Path | None = None,
    *,
    op_types: Sequence[str] | None = DEFAULT_OP_TYPES,
    nodes_to_exclude: Sequence[str] = (),
    progress: Progress | None = None,
    model_digest: str | None = None,
) -> dict[str, Any]:
    """Write the Q/DQ model of ``fp32_model`` to ``out`` (atomically), calibrated on
    ``samples``; the activation ranges are read from or written to ``ranges_cache``. Returns a
    summary for the build manifest: method, samples, whether the ranges were cached, node
    counts. ``op_types=None`` quantizes every op type ORT can; ``model_digest`` (the sha256 of
    ``fp32_model``, when the caller has it) saves hashing the model again."""
    if method not in METHODS:
        raise BuildError(f"unknown calibration method {method!r}; use {', '.join(METHODS)}")
    if len(samples) == 0:
        raise BuildError("no calibration samples")
    report: Progress = progress or (lambda phase, frac: None)
    started = time.monotonic()
    ops = list(op_types) if op_types is not None else _all_op_types()
    key = ranges_key(model_digest or file_digest(fp32_model), samples.digest, method, percentile, op_types)
    out.parent.mkdir(parents=True, exist_ok=True)
    # The work files (model copies, the augmented model) go next to the output, on the cache's
    # disk: /tmp is often a RAM-backed tmpfs on a Jetson.
    with tempfile.TemporaryDirectory(prefix=f".tmp-{os.getpid()}-quant-", dir=out.parent) as tmpdir:
        work = Path(tmpdir)
        report("preparing", None)
        prepared, opset = _prepare(fp32_model, work)
        ranges, status = _ensure_ranges(prepared, samples, method, percentile, ops, key, ranges_cache, work, report)
        report("quantizing", None)
        tmp_out = work / "qdq.onnx"
        _run_quantizer(prepared, tmp_out, method, ops, nodes_to_exclude, ranges)
        model = _finish(tmp_out, out)
    summary = {
        "method": method,
        "percentile": percentile if method == "percentile" else None,
        "samples": len(samples),
        "ranges_key": key,
        "opset": opset,
        "ranges": status,
        "op_types": ops,
        "nodes_to_exclude": list(nodes_to_exclude),
        "seconds": round(time.monotonic() - started, 2),
        **qdq_nodes_summary(model, ops),
    }
    log.info(
        "quantized %s: %s, %d samples, ranges %s, %d Q/DQ pairs in %.1fs",
        fp32_model.name,
        method,
        len(samples),
        summary["ranges"],
        summary["dequantize_nodes"],
        summary["seconds"],
    )
    return summary


def _ensure_ranges(
    prepared: Path,
    samples: CalibrationSet,
    method: str,
    percentile: float,
    ops: list[str],
    key: str,
    ranges_cache: Path | None,
    work: Path,
    report: Progress,
) -> tuple[Path | TensorsData, str]:
    """The activation ranges: a ranges file quantize_static reads ("cached" or "computed"), or,
    on an ORT that cannot take one, the ranges themselves ("computed", not cached)."""
    if not _ORT_TAKES_RANGES:
        return _compute_ranges(prepared, samples, method, percentile, ops, work, report), "computed"
    ranges_file = ranges_cache or work / "ranges.json"
    if ranges_cache is not None and _cached_ranges(ranges_file, key):
        return ranges_file, "cached"
    ranges = _compute_ranges(prepared, samples, method, percentile, ops, work, report)
    ranges_file.parent.mkdir(parents=True, exist_ok=True)
    _write_ranges(ranges, ranges_file, key, {"method": method, "samples": len(samples), "data": samples.digest})
    return ranges_file, "computed"


def _finish(tmp_out: Path, out: Path) -> onnx.ModelProto:
    model = onnx.load(str(tmp_out))
    if float_graph_outputs(model):
        onnx.save(model, str(tmp_out))
    problems = check_qdq(model)
    if problems:
        raise BuildError(f"the Q/DQ model breaks TensorRT's rules: {'; '.join(problems[:5])}")
    os.replace(tmp_out, out)
    return model


def _run_quantizer(
    prepared: Path,
    out: Path,
    method: str,
    ops: list[str],
    nodes_to_exclude: Sequence[str],
    ranges: Path | TensorsData,
) -> None:
    try:
        with _quiet():
            if isinstance(ranges, TensorsData):
                _quantize_with_ranges(prepared, out, ops, nodes_to_exclude, ranges)
                return
            quantize_static(
                str(prepared),
                str(out),
                calibration_data_reader=None,
                quant_format=QuantFormat.QDQ,
                op_types_to_quantize=ops,
                per_channel=True,
                reduce_range=False,
                activation_type=QuantType.QInt8,
                weight_type=QuantType.QInt8,
                nodes_to_exclude=list(nodes_to_exclude),
                calibrate_method=METHODS[method],
                extra_options=dict(QDQ_OPTIONS),
                calibration_cache_path=str(ranges),
            )
    except BuildError:
        raise
    except Exception as e:  # ORT raises bare ValueError/RuntimeError for model problems
        raise BuildError(f"onnxruntime quantization failed: {type(e).__name__}: {e}") from e


def _quantize_with_ranges(
    prepared: Path, out: Path, ops: list[str], nodes_to_exclude: Sequence[str], ranges: TensorsData
) -> None:
    """What quantize_static does after calibrating (ORT 1.17-1.23), with edged's ranges."""
    from onnxruntime.quantization.qdq_quantizer import QDQQuantizer
    from onnxruntime.quantization.quant_utils import load_model_with_shape_infer, update_opset_version

    model = update_opset_version(load_model_with_shape_infer(prepared), QuantType.QInt8)
    quantizer = QDQQuantizer(
        model,
        True,  # per_channel
        False,  # reduce_range
        QuantType.QInt8,
        QuantType.QInt8,
        ranges,
        [],  # nodes_to_quantize: all of op_types_to_quantize
        list(nodes_to_exclude),
        ops,
        dict(QDQ_OPTIONS),
    )
    quantizer.quantize_model()
    quantizer.model.save_model_to_file(str(out), False)
