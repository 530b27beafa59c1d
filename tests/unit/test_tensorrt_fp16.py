"""Strongly typed INT8 builds get a Q/DQ model whose float parts are FP16: the dtypes of the graph
``build.py`` hands TensorRT's parser, checked with ONNX's own type inference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edged.backends.tensorrt.build import network_source
from edged.backends.tensorrt.fp16 import to_mixed_fp16
from edged.backends.tensorrt.versions import BuildOptions, ModelTraits, plan_build
from edged.errors import BuildError

F, H = TensorProto.FLOAT, TensorProto.FLOAT16


def init(name: str, arr: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(arr, name)


def detector_like(path: Path, weight_scale: float = 0.02, input_scale: float = 0.05) -> Path:
    """x -> Q/DQ -> Conv(Q/DQ weights) -> HardSigmoid*x (hard-swish) -> Resize -> Conv -> Sigmoid
    (the output), plus a Conv left unquantized (as the mixed-precision search leaves one)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    w2 = rng.standard_normal((1, 4, 1, 1)).astype(np.float32)
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s_x", "z"], ["xq"], name="q_x"),
        helper.make_node("DequantizeLinear", ["xq", "s_x", "z"], ["xd"], name="dq_x"),
        helper.make_node("QuantizeLinear", ["w", "s_w", "z4"], ["wq"], name="q_w", axis=0),
        helper.make_node("DequantizeLinear", ["wq", "s_w", "z4"], ["wd"], name="dq_w", axis=0),
        helper.make_node("Conv", ["xd", "wd", "b"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("HardSigmoid", ["c1"], ["hs"], name="hsig"),
        helper.make_node("Mul", ["c1", "hs"], ["act"], name="hswish"),
        helper.make_node("Resize", ["act", "", "scales"], ["up"], name="resize", mode="nearest"),
        helper.make_node("Conv", ["up", "w2"], ["c2"], name="conv_excluded"),
        helper.make_node("Sigmoid", ["c2"], ["y"], name="final_sigmoid"),
    ]
    graph = helper.make_graph(
        nodes,
        "det",
        [helper.make_tensor_value_info("x", F, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", F, [1, 1, 16, 16])],
        [
            init("s_x", np.array(input_scale, np.float32)),
            init("z", np.array(0, np.int8)),
            init("w", w),
            init("s_w", np.full(4, weight_scale, np.float32)),
            init("z4", np.zeros(4, np.int8)),
            init("b", np.zeros(4, np.float32)),
            init("scales", np.array([1, 1, 2, 2], np.float32)),
            init("w2", w2),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def dtypes(path: Path) -> dict[str, int]:
    """Every tensor's element type as ONNX infers it (strictly: a wrong type raises)."""
    model = onnx.shape_inference.infer_shapes(onnx.load(str(path)), strict_mode=True)
    g = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*g.input, *g.output, *g.value_info]}
    types.update({i.name: i.data_type for i in g.initializer})
    return types


def producer(path: Path) -> dict[str, Any]:
    return {n.name: n for n in onnx.load(str(path)).graph.node}


def test_float_parts_become_fp16_with_outputs_and_the_final_sigmoid_fp32(tmp_path: Path) -> None:
    out = tmp_path / "mixed.onnx"
    summary = to_mixed_fp16(detector_like(tmp_path / "det.onnx"), out)
    t = dtypes(out)
    nodes = producer(out)
    opset = next(o.version for o in onnx.load(str(out)).opset_import if o.domain == "")
    assert opset >= 19  # FP16 scales on Q/DQ need opset 19
    assert t["x"] == F and t["y"] == F  # the model's interface is unchanged
    assert t[nodes["dq_x"].output[0]] == H and t[nodes["dq_w"].output[0]] == H  # DQ hands FP16 on
    assert t[nodes["dq_x"].input[1]] == H and t[nodes["q_w"].input[0]] == H  # FP16 scale and weight
    assert nodes["conv1"].input[0] == nodes["dq_x"].output[0]  # no Cast between DQ and its Conv
    assert t["c1"] == H and t["hs"] == H and t["act"] == H and t["up"] == H
    assert t[nodes["resize"].input[2]] == F  # Resize's scales are float32 by schema
    assert t["c2"] == H  # the Conv left out of INT8 runs FP16 too
    assert t[nodes["final_sigmoid"].output[0]] == F and t[nodes["final_sigmoid"].input[0]] == F
    assert summary["kept_fp32"] == ["final_sigmoid"] and summary["opset"] == 19


def test_keep_fp32_replaces_the_default_list(tmp_path: Path) -> None:
    out = tmp_path / "mixed.onnx"
    to_mixed_fp16(detector_like(tmp_path / "det.onnx"), out, keep_fp32=["HardSigmoid", "conv_excluded"])
    t, nodes = dtypes(out), producer(out)
    assert t["hs"] == F and t["c2"] == F
    assert t[nodes["final_sigmoid"].output[0]] == H  # the default list would keep it: replaced, it is not
    assert t["act"] == H and t["y"] == F


def dequantized(model: onnx.ModelProto, dq_name: str) -> np.ndarray:
    """What a weight's Q/DQ pair hands its layer, computed as ONNX defines it (in float64)."""
    g = model.graph
    inits = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in g.initializer}
    nodes = {n.name: n for n in g.node}
    producer = {o: n for n in g.node for o in n.output}
    dq = nodes[dq_name]
    q = producer[dq.input[0]]
    w, s = inits[q.input[0]], inits[q.input[1]].reshape(-1, 1, 1, 1)
    return np.clip(np.rint(w / s), -128, 127) * s


def test_a_weight_scale_below_fp16s_range_is_raised_and_the_conv_keeps_its_dq(tmp_path: Path) -> None:
    """A weight scale of 1e-6 is below FP16's smallest normal (2**-14): kept, its Q/DQ pair
    would stay FP32 and need a Cast before the Conv, which TensorRT then cannot fuse into INT8."""
    source = detector_like(tmp_path / "det.onnx", weight_scale=1e-6)
    out = tmp_path / "mixed.onnx"
    summary = to_mixed_fp16(source, out)
    t, nodes = dtypes(out), producer(out)
    assert summary["raised_weight_scales"] == 1 and "DequantizeLinear" not in summary["fp32_ops"]
    assert t[nodes["dq_w"].input[1]] == H and t[nodes["dq_w"].output[0]] == H
    assert nodes["conv1"].input[1] == nodes["dq_w"].output[0]  # the DQ right before the Conv
    scale = numpy_helper.to_array(next(i for i in onnx.load(str(out)).graph.initializer if i.name == "s_w__fp16"))
    assert (scale.astype(np.float32) == np.float32(2.0**-14)).all()
    # The weight keeps what its pair dequantized to (its clipping included) within half the new step.
    before, after = dequantized(onnx.load(str(source)), "dq_w"), dequantized(onnx.load(str(out)), "dq_w")
    assert np.abs(after - before).max() <= 2.0**-15 + 1e-9


def test_an_activation_scale_below_fp16s_range_keeps_its_pair_fp32(tmp_path: Path) -> None:
    out = tmp_path / "mixed.onnx"
    summary = to_mixed_fp16(detector_like(tmp_path / "det.onnx", input_scale=1e-6), out)
    t, nodes = dtypes(out), producer(out)
    assert t[nodes["dq_x"].input[1]] == F  # an activation's range is data, not weights: not raised
    assert summary["raised_weight_scales"] == 0 and summary["fp32_ops"].get("DequantizeLinear") == 1
    assert t["c1"] == H


def test_an_int8_weight_is_requantized_to_the_raised_scale() -> None:
    from edged.backends.tensorrt.fp16 import raise_weight_scales

    q = np.array([[127, -64, 3], [100, 0, -1]], np.int8)
    scale = np.array([1e-6, 0.01], np.float32)
    graph = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["q", "s", "z"], ["w"], axis=0, name="dq")],
        "g",
        [],
        [helper.make_tensor_value_info("w", F, [2, 3])],
        [init("q", q), init("s", scale), init("z", np.zeros(2, np.int8))],
    )
    assert raise_weight_scales(graph) == 1
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    assert inits["s"][1] == np.float32(0.01) and inits["s"][0] == np.float32(2.0**-14)
    before = q.astype(np.float64) * scale.astype(np.float64)[:, None]
    after = inits["q"].astype(np.float64) * inits["s"].astype(np.float64)[:, None]
    assert np.abs(after - before).max() <= 2.0**-15 and (inits["q"][1] == q[1]).all()


@pytest.mark.parametrize(
    "version, options, converted",
    [
        ((10, 3, 0), {}, True),
        ((11, 1, 0), {}, True),
        ((10, 3, 0), {"float_parts": "fp32"}, False),
        ((8, 6, 1), {}, False),  # weakly typed: the FP16 builder flag does it
    ],
)
def test_the_graph_handed_to_the_parser(
    tmp_path: Path, version: tuple[int, int, int], options: dict[str, Any], converted: bool
) -> None:
    source = detector_like(tmp_path / "det.onnx")
    opts = BuildOptions.from_mapping(options)
    plan = plan_build(version, "int8", opts, ModelTraits(qdq=True, fp16=False), str(source))
    with network_source(str(source), plan, opts, tmp_path) as (parsed, info):
        t = dtypes(Path(parsed))
        assert (t["c1"] == H) == converted and t["y"] == F
        assert info["float_parts"] == ("fp16" if converted else ("fp32" if version[0] >= 10 else "builder flags"))
    assert not any(p.name.startswith(".tmp-fp16-") for p in tmp_path.iterdir())  # cleaned up


def test_the_search_excluded_nodes_run_fp16(tmp_path: Path) -> None:
    """With the project's own quantizer: a Gemm excluded from INT8 still gets FP16."""
    from edged.backends.base import TensorSpec
    from edged.config import CalibrationConfig
    from edged.quantize.calibrate import CalibrationSet
    from edged.quantize.qdq import quantize_qdq
    from edged.tools.demo import make_tiny_mlp

    mlp = make_tiny_mlp(tmp_path / "mlp.onnx")
    model = onnx.load(str(mlp))
    for i, node in enumerate(model.graph.node):  # the search names nodes; the demo MLP has none
        node.name = f"{node.op_type.lower()}_{i}"
    onnx.save(model, str(mlp))
    first = next(n.name for n in model.graph.node if n.op_type == "Gemm")
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(1)
    for i in range(8):
        np.save(data / f"{i}.npy", rng.standard_normal((4, 16), dtype=np.float32))
    samples = CalibrationSet.load(CalibrationConfig(data=str(data)), [TensorSpec("x", "float32", (-1, 16))])
    qdq = tmp_path / "excluded.qdq.onnx"
    quantize_qdq(mlp, qdq, samples, nodes_to_exclude=[first])
    out = tmp_path / "mixed.onnx"
    summary = to_mixed_fp16(qdq, out, float_nodes=[first])  # as the pipeline names them
    assert summary["float_nodes_fp16"] == "1 of 1"
    graph = onnx.load(str(out)).graph
    t = dtypes(out)
    gemms = [n for n in graph.node if n.op_type == "Gemm"]
    assert all(t[g.output[0]] == H for g in gemms)
    feeding = {o: n.op_type for n in graph.node for o in n.output}
    fed = {g.name: feeding.get(g.input[0]) for g in gemms}
    assert fed[first] != "DequantizeLinear"  # really left out of INT8...
    assert [f for name, f in fed.items() if name != first] == ["DequantizeLinear"]  # ...and only it


def test_an_unreadable_model_is_a_build_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"nope")
    with pytest.raises(BuildError, match="cannot prepare the model for FP16"):
        to_mixed_fp16(bad, tmp_path / "out.onnx")


# --- the demo detector ------------------------------------------------------------------------------

WEIGHTED = ("Conv", "ConvTranspose")


@pytest.fixture(scope="module")
def detector_qdq(demo_models: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The demo detector (PP-OCRv4, 62 Conv and 2 ConvTranspose) quantized by edged's recipe on
    rendered text pages: all-INT8, and with two convolutions kept in float as the search keeps
    them (one of them among those whose weight scales are below FP16's range)."""
    import onnxruntime

    from edged.backends.base import TensorSpec
    from edged.config import CalibrationConfig
    from edged.quantize.calibrate import CalibrationSet
    from edged.quantize.qdq import quantize_qdq
    from edged.tools.selftest_checks import render_pages

    if tuple(int(x) for x in onnxruntime.__version__.split(".")[:2]) < (1, 24):
        # ONNX Runtime 1.23 (the last for Python 3.10) stops its symbolic shape inference on this
        # model ("Incomplete symbolic shape inference"), so its Q/DQ model cannot be made here.
        pytest.skip(f"onnxruntime {onnxruntime.__version__} cannot quantize the demo detector")
    work = tmp_path_factory.mktemp("detector")
    pages = render_pages(work / "pages", 6, size=160)
    cal = CalibrationConfig(data=str(pages), resize=[160, 160], color="BGR", mean=[0.5] * 3, std=[0.5] * 3)
    samples = CalibrationSet.load(cal, [TensorSpec("x", "float32", (-1, 3, -1, -1))])
    out = {}
    for name, excluded in (("all", []), ("mixed", ["p2o.Conv.3", "p2o.Conv.22"])):
        out[name] = work / f"{name}.qdq.onnx"
        quantize_qdq(demo_models, out[name], samples, ranges_cache=work / "ranges.json", nodes_to_exclude=excluded)
    return out


def _feeders(path: Path) -> tuple[list[Any], dict[str, Any], dict[str, int]]:
    model = onnx.load(str(path))
    g = model.graph
    return [n for n in g.node if n.op_type in WEIGHTED], {o: n for n in g.node for o in n.output}, dtypes(path)


@pytest.mark.parametrize("variant, int8, raised", [("all", 64, 9), ("mixed", 62, 8)])
def test_every_int8_convolution_of_the_demo_detector_has_its_dq_right_before_it(
    detector_qdq: dict[str, Path], tmp_path: Path, variant: str, int8: int, raised: int
) -> None:
    """TensorRT runs a convolution INT8 only when a DequantizeLinear feeds it directly, for the
    activation and for the weight. Nine of the detector's weights have channels whose scales are
    below FP16's normal range: raised to it, none of them needs a Cast before its convolution."""
    excluded = {"all": set(), "mixed": {"p2o.Conv.3", "p2o.Conv.22"}}[variant]
    out = tmp_path / "mixed.onnx"
    summary = to_mixed_fp16(detector_qdq[variant], out, float_nodes=sorted(excluded))
    convs, producer_of, t = _feeders(out)
    assert len(convs) == 64
    quantized = [c for c in convs if c.name not in excluded]
    assert len(quantized) == int8
    not_fed = [
        c.name
        for c in quantized
        for i in (0, 1)
        if producer_of.get(c.input[i]) is None or producer_of[c.input[i]].op_type != "DequantizeLinear"
    ]
    assert not_fed == []
    assert all(t[producer_of[c.input[i]].output[0]] == H for c in quantized for i in (0, 1))  # FP16 hand-over
    assert summary["raised_weight_scales"] == raised  # weights alone decide it (p2o.Conv.22 is one)
    for c in convs:  # the ones the search keeps in float run FP16, fed by no DQ
        if c.name in excluded:
            weight = producer_of.get(c.input[1])
            assert (weight is None or weight.op_type != "DequantizeLinear") and t[c.output[0]] == H
