"""The Q/DQ model: its graph has the form TensorRT's explicit quantization accepts, it runs on
ONNX Runtime close to the FP32 model, and its activation ranges are cached and reused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edged.backends.base import BuildSpec, LoadOptions, TensorSpec
from edged.backends.onnxruntime import OnnxRuntimeBackend, ort_session
from edged.config import CalibrationConfig
from edged.errors import BuildError
from edged.quantize import qdq as quantize
from edged.quantize.calibrate import CalibrationSet
from edged.quantize.qdq import quantize_qdq
from edged.quantize.qdq_graph import check_qdq

C1, C2, HID, CLASSES = 8, 6, 12, 5
SPEC = TensorSpec("x", "float32", (-1, 3, 16, 16))


def conv_net(path: Path, opset: int = 17) -> Path:
    """Conv → Relu → MaxPool → ConvTranspose → Relu → GlobalAveragePool → Flatten →
    Gemm(transB=1) → Relu → MatMul → Add: every weighted op with its own weight layout."""
    rng = np.random.default_rng(3)

    def w(name: str, *shape: int, scale: float = 0.3) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    inits = [
        w("cw", C1, 3, 3, 3),
        w("cb", C1, scale=0.1),
        w("tw", C1, C2, 2, 2),
        w("gw", HID, C2),
        w("gb", HID, scale=0.1),
        w("mw", HID, CLASSES),
        w("mb", CLASSES, scale=0.1),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "cw", "cb"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("ConvTranspose", ["p", "tw"], ["t"], strides=[2, 2], name="deconv"),
        helper.make_node("Relu", ["t"], ["tr"]),
        helper.make_node("GlobalAveragePool", ["tr"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
        helper.make_node("Gemm", ["f", "gw", "gb"], ["h"], transB=1, name="gemm"),
        helper.make_node("Relu", ["h"], ["hr"]),
        helper.make_node("MatMul", ["hr", "mw"], ["logits"], name="matmul"),
        helper.make_node("Add", ["logits", "mb"], ["shifted"]),
    ]
    graph = helper.make_graph(
        nodes,
        "convnet",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 16, 16])],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", CLASSES]),
            helper.make_tensor_value_info("shifted", TensorProto.FLOAT, ["N", CLASSES]),
        ],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("quant")


@pytest.fixture(scope="module")
def fp32(workdir: Path) -> Path:
    return conv_net(workdir / "net.onnx")


@pytest.fixture(scope="module")
def samples(workdir: Path) -> CalibrationSet:
    folder = workdir / "data"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(8):
        np.save(folder / f"{i}.npy", rng.standard_normal((2, 3, 16, 16)).astype(np.float32))
    return CalibrationSet.load(CalibrationConfig(data=str(folder)), [SPEC])


@pytest.fixture(scope="module")
def qdq(workdir: Path, fp32: Path, samples: CalibrationSet) -> tuple[Path, dict[str, Any]]:
    out = workdir / "net.qdq.onnx"
    summary = quantize_qdq(fp32, out, samples, "minmax", ranges_cache=workdir / "net.ranges.json")
    return out, summary


def _graph(path: Path) -> tuple[onnx.ModelProto, dict[str, Any], dict[str, list[Any]]]:
    model = onnx.load(str(path))
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    consumers: dict[str, list[Any]] = {}
    for n in model.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    return model, inits, consumers


def _weight_dq(model: onnx.ModelProto, node_name: str) -> Any:
    producer = {o: n for n in model.graph.node for o in n.output}
    node = next(n for n in model.graph.node if n.name.split("/")[0] == node_name)
    dq = producer[node.input[1]]
    assert dq.op_type == "DequantizeLinear"
    return dq


def _axis(node: Any) -> int | None:
    return next((a.i for a in node.attribute if a.name == "axis"), None)


# --- the graph -----------------------------------------------------------------------------------


def test_qdq_graph_is_symmetric_int8(qdq: tuple[Path, dict[str, Any]]) -> None:
    model, inits, consumers = _graph(qdq[0])
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("QuantizeLinear") > 0 and ops.count("DequantizeLinear") > 0
    assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= 13
    for n in model.graph.node:
        if n.op_type in ("QuantizeLinear", "DequantizeLinear"):
            scale, zp = inits[n.input[1]], inits[n.input[2]]
            assert zp.dtype == np.int8, n.name
            assert not zp.any(), f"{n.name}: zero point {zp}"
            assert (scale > 0).all(), n.name
        if n.op_type == "DequantizeLinear":
            # a dedicated pair per consumer: TensorRT fuses a DQ into the one layer after it
            assert len(consumers.get(n.output[0], [])) == 1, n.name
            # biases stay float: no INT32 DequantizeLinear
            assert n.input[0] not in inits or inits[n.input[0]].dtype == np.int8
    assert check_qdq(model) == []


@pytest.mark.parametrize(
    ("node", "axis", "channels"),
    [("conv", 0, C1), ("deconv", 1, C2), ("gemm", 0, HID), ("matmul", 1, CLASSES)],
)
def test_weights_are_per_channel_on_the_output_axis(
    qdq: tuple[Path, dict[str, Any]], node: str, axis: int, channels: int
) -> None:
    model, inits, _ = _graph(qdq[0])
    dq = _weight_dq(model, node)
    assert _axis(dq) == axis
    assert inits[dq.input[1]].shape == (channels,)
    producer = {o: n for n in model.graph.node for o in n.output}
    q = producer[dq.input[0]]  # float weight → Q → DQ (TensorRT 8.x wants FP32 weights)
    assert q.op_type == "QuantizeLinear" and _axis(q) == axis
    assert inits[q.input[0]].dtype == np.float32


def test_graph_outputs_stay_float(qdq: tuple[Path, dict[str, Any]]) -> None:
    # ORT would end the model with Q/DQ on the logits: 256 levels for the answer, no speed
    model, _, _ = _graph(qdq[0])
    producer = {o: n for n in model.graph.node for o in n.output}
    assert {o.name: producer[o.name].op_type for o in model.graph.output} == {"logits": "MatMul", "shifted": "Add"}


def test_activations_are_quantized_per_tensor(qdq: tuple[Path, dict[str, Any]]) -> None:
    model, inits, _ = _graph(qdq[0])
    conv = next(n for n in model.graph.node if n.name == "conv")
    producer = {o: n for n in model.graph.node for o in n.output}
    dq = producer[conv.input[0]]
    assert dq.op_type == "DequantizeLinear" and inits[dq.input[1]].ndim == 0


def test_summary_counts_the_graph(qdq: tuple[Path, dict[str, Any]], samples: CalibrationSet) -> None:
    model, _, _ = _graph(qdq[0])
    summary = qdq[1]
    ops = [n.op_type for n in model.graph.node]
    assert summary["method"] == "minmax" and summary["samples"] == len(samples) == 8
    assert summary["quantize_nodes"] == ops.count("QuantizeLinear")
    assert summary["dequantize_nodes"] == ops.count("DequantizeLinear")
    for op in ("Conv", "ConvTranspose", "Gemm", "MatMul"):
        assert summary["quantized_ops"].get(op) == 1, op
    # ORT quantizes a MaxPool only when its input already is; here a float Relu comes first
    assert summary["unquantized_ops"] == {"MaxPool": 1}
    assert "Add" not in summary["quantized_ops"]  # not in the default op types
    json.dumps(summary)


def test_qdq_model_runs_close_to_fp32(fp32: Path, qdq: tuple[Path, dict[str, Any]], samples: CalibrationSet) -> None:
    # With edged's session config, as the daemon and the gate run it: on an x86 CPU without
    # VNNI a plain session saturates int16 sums in ORT's U8S8 kernels (relative L2 0.32 here).
    ref, cand = ort_session(str(fp32)), ort_session(str(qdq[0]))
    x = next(iter(samples))
    a, b = ref.run(None, x)[0], cand.run(None, x)[0]
    assert b.dtype == np.float32 and b.shape == a.shape
    assert np.linalg.norm(b - a) / np.linalg.norm(a) < 0.1


def test_built_onnxruntime_artefact_runs_close_to_fp32(
    workdir: Path, fp32: Path, qdq: tuple[Path, dict[str, Any]], samples: CalibrationSet
) -> None:
    # The daemon serves the model as ORT's optimiser wrote it (fused int8 kernels, weights
    # converted for this CPU) and loads it without optimising again: that file must be right.
    artefact = workdir / "net.ort.onnx"
    OnnxRuntimeBackend.build(BuildSpec(source=str(qdq[0]), precision="int8"), artefact, lambda phase, frac: None)
    backend = OnnxRuntimeBackend(artefact, LoadOptions(threads=1))
    backend.load()
    try:
        ref = ort_session(str(fp32))
        for x in samples:
            a, b = ref.run(["logits"], x)[0], backend.instance().infer(x)["logits"]
            assert np.linalg.norm(b - a) / np.linalg.norm(a) < 0.1
    finally:
        backend.unload()


def test_opset_12_model_is_converted(workdir: Path, samples: CalibrationSet) -> None:
    old = conv_net(workdir / "old.onnx", opset=12)
    out = workdir / "old.qdq.onnx"
    summary = quantize_qdq(old, out, samples, "minmax")
    model = onnx.load(str(out))
    assert summary["opset"] == 13
    assert [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] == [13]
    assert _axis(_weight_dq(model, "conv")) == 0


# --- methods and the ranges cache -------------------------------------------------------------


def _input_scale(path: Path) -> float:
    model, inits, _ = _graph(path)
    conv = next(n for n in model.graph.node if n.name == "conv")
    producer = {o: n for n in model.graph.node for o in n.output}
    return float(inits[producer[conv.input[0]].input[1]])


def test_methods_give_different_ranges(
    workdir: Path, fp32: Path, samples: CalibrationSet, qdq: tuple[Path, dict[str, Any]]
) -> None:
    scales = {"minmax": _input_scale(qdq[0])}
    for method in ("entropy", "percentile"):
        out = workdir / f"net.{method}.onnx"
        summary = quantize_qdq(fp32, out, samples, method, percentile=99.0)
        assert summary["method"] == method
        scales[method] = _input_scale(out)
    # clipping outliers (entropy, the 99th percentile) gives a smaller scale than the full range
    assert scales["percentile"] < scales["minmax"]
    assert scales["entropy"] < scales["minmax"]
    assert scales["entropy"] != scales["percentile"]


def ort_version() -> str:
    import onnxruntime

    return str(onnxruntime.__version__)


def test_ranges_cache_is_reused_and_keyed(
    workdir: Path,
    fp32: Path,
    samples: CalibrationSet,
    qdq: tuple[Path, dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache = workdir / "net.ranges.json"
    if not quantize._ORT_TAKES_RANGES:
        # An onnxruntime that cannot take precomputed ranges (1.17-1.23: Python 3.10, JetPack's
        # wheels): nothing is cached, and each quantization computes its ranges again.
        assert qdq[1]["ranges"] == "computed" and not cache.exists(), ort_version()
        computed: list[object] = []
        compute = quantize._compute_ranges

        def counted(*args: Any, **kwargs: Any) -> Any:
            computed.append(args)
            return compute(*args, **kwargs)

        with monkeypatch.context() as m:
            m.setattr(quantize, "_compute_ranges", counted)
            redone = quantize_qdq(fp32, workdir / "net.again.onnx", samples, "minmax", ranges_cache=cache)
        assert redone["ranges"] == "computed" and len(computed) == 1 and not cache.exists()
        assert _input_scale(workdir / "net.again.onnx") == _input_scale(qdq[0])
        return

    data = json.loads(cache.read_bytes())
    assert data["edged"]["key"] == qdq[1]["ranges_key"] and data["edged"]["method"] == "minmax"
    assert qdq[1]["ranges"] == "computed"

    def no_calibration(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("calibrated again despite a matching ranges cache")

    with monkeypatch.context() as m:
        m.setattr(quantize, "_compute_ranges", no_calibration)
        again = workdir / "net.again.onnx"
        summary = quantize_qdq(fp32, again, samples, "minmax", ranges_cache=cache)
    assert summary["ranges"] == "cached" and summary["ranges_key"] == qdq[1]["ranges_key"]
    assert _input_scale(again) == _input_scale(qdq[0])

    # another method, or other data, is another key: the cache is recomputed, not misused
    calib, _ = samples.split(0.25)
    other = quantize_qdq(fp32, workdir / "net.other.onnx", calib, "minmax", ranges_cache=cache)
    assert other["ranges"] == "computed" and other["ranges_key"] != qdq[1]["ranges_key"]
    assert json.loads(cache.read_bytes())["edged"]["key"] == other["ranges_key"]


def test_without_ort_ranges_support_the_same_ranges_reach_the_quantizer(
    workdir: Path,
    fp32: Path,
    samples: CalibrationSet,
    qdq: tuple[Path, dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An ORT that cannot take a ranges file (1.17-1.23, JetPack's wheels, Python 3.10) gets edged's
    # own ranges through its QDQ quantizer: the same model as the ranges-file path, nothing cached.
    monkeypatch.setattr(quantize, "_ORT_TAKES_RANGES", False)
    out = workdir / "net.fallback.onnx"
    summary = quantize_qdq(fp32, out, samples, "minmax", ranges_cache=workdir / "unused.json")
    assert summary["ranges"] == "computed" and not (workdir / "unused.json").exists()
    assert check_qdq(onnx.load(str(out))) == []
    assert _input_scale(out) == _input_scale(qdq[0])


def test_bad_inputs_are_build_errors(workdir: Path, fp32: Path, samples: CalibrationSet) -> None:
    with pytest.raises(BuildError, match="unknown calibration method 'kl'"):
        quantize_qdq(fp32, workdir / "x.onnx", samples, "kl")
    (workdir / "garbage.onnx").write_bytes(b"not a model")
    with pytest.raises(BuildError, match="cannot load ONNX model"):
        quantize_qdq(workdir / "garbage.onnx", workdir / "x.onnx", samples)
    assert not (workdir / "x.onnx").exists()


def test_check_qdq_flags_what_tensorrt_refuses(qdq: tuple[Path, dict[str, Any]]) -> None:
    model = onnx.load(str(qdq[0]))
    zp = next(i for i in model.graph.initializer if i.name.endswith("zero_point"))
    zp.CopyFrom(numpy_helper.from_array(np.array(3, np.int8), zp.name))
    assert any("non-zero zero point" in p for p in check_qdq(model))
    zp.CopyFrom(numpy_helper.from_array(np.array(0, np.uint8), zp.name))
    assert any("not INT8" in p for p in check_qdq(model))
