"""The Jetson self-test's parts that run anywhere: its report without TensorRT, its Q/DQ recipe,
its synthetic data and its gate metrics."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from edged.backends.tensorrt.versions import read_model_traits
from edged.config import from_mapping
from edged.selftest import _demo, gate_metrics, quantize_qdq, run_selftest, synthetic_feeds


def _tensorrt_runs() -> bool:
    from edged.backends.tensorrt import TensorRTBackend

    return TensorRTBackend.available()[0]


@pytest.mark.skipif(_tensorrt_runs(), reason="TensorRT is usable here: the full test would run")
def test_without_tensorrt_the_report_says_why_and_exits_2() -> None:
    out = io.StringIO()
    assert run_selftest(None, out) == 2
    text = out.getvalue()
    assert "platform" in text and "memory" in text
    assert "tensorrt    : NOT USABLE" in text
    assert text.rstrip().endswith("ERROR: the TensorRT backend is not usable here")


def test_a_missing_config_is_reported_not_raised(tmp_path: Path) -> None:
    out = io.StringIO()
    assert run_selftest(str(tmp_path / "nope.toml"), out) == 2
    assert "cannot read config" in out.getvalue()


def test_the_demo_is_the_configured_model_when_its_file_exists(tmp_path: Path) -> None:
    from edged.demo import make_tiny_mlp

    model = make_tiny_mlp(tmp_path / "m.onnx")
    cfg = from_mapping(
        {
            "models": {
                "gone": {"path": str(tmp_path / "gone.onnx")},
                "mine": {"path": str(model), "profiles": {"x": {"min": [1, 16], "opt": [2, 16], "max": [4, 16]}}},
            }
        }
    )
    demo = _demo(cfg, tmp_path)
    assert demo.path == model and "mine" in demo.origin
    assert demo.profiles == {"x": ((1, 16), (2, 16), (4, 16))}
    fallback = _demo(from_mapping({}), tmp_path)
    assert fallback.path.is_file()
    assert "tiny MLP" in fallback.origin or "demo detector" in fallback.origin


def test_synthetic_pages_look_like_normalised_images() -> None:
    feeds = synthetic_feeds([("img", (1, 3, 64, 96), "float32"), ("v", (2, 5), "float16")], 3, 0)
    assert len(feeds) == 3
    img = feeds[0]["img"]
    assert img.shape == (1, 3, 64, 96) and img.dtype == np.float32
    assert -2.5 < img.min() < 0 < img.max() < 2.7  # ImageNet-normalised [0, 1] pixels
    assert feeds[1]["v"].dtype == np.float16
    assert not np.array_equal(feeds[0]["img"], feeds[1]["img"])


def test_gate_metrics() -> None:
    ref = [{"p": np.array([[0.1, 0.9], [0.8, 0.2]])}]
    same = gate_metrics(ref, ref)
    assert same["rel_l2"] == 0 and same["cosine"] == pytest.approx(1) and same["top1"] == 1
    flipped = gate_metrics(ref, [{"p": np.array([[0.9, 0.1], [0.8, 0.2]])}])
    assert flipped["top1"] == 0.5 and flipped["rel_l2"] > 0.5 and flipped["cosine"] < 0.9


def test_the_qdq_recipe_gives_what_tensorrt_builds(tmp_path: Path) -> None:
    import onnx

    from edged.demo import make_tiny_mlp

    fp32 = make_tiny_mlp(tmp_path / "tiny.onnx")
    feeds = synthetic_feeds([("x", (4, 16), "float32")], 16, seed=1)
    qdq = quantize_qdq(fp32, tmp_path / "tiny.qdq.onnx", feeds)
    assert read_model_traits(str(qdq)).qdq
    graph = onnx.load(str(qdq)).graph
    inits = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "DequantizeLinear":
            source = inits.get(node.input[0])
            # TensorRT dequantizes int8 only: biases stay float, nothing is int32.
            assert source is None or source.data_type == onnx.TensorProto.INT8
            zero = inits.get(node.input[2]) if len(node.input) > 2 else None
            assert zero is None or not onnx.numpy_helper.to_array(zero).any()  # symmetric
    # per-channel weight scales: one per output column of the first Gemm (16x32 weights)
    scales = [onnx.numpy_helper.to_array(t) for t in graph.initializer if t.name.endswith("scale")]
    assert any(s.shape == (32,) for s in scales)
    import onnxruntime as ort

    def run(path: Path) -> list[dict[str, np.ndarray]]:
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return [{"probs": sess.run(None, f)[0]} for f in feeds]

    metrics = gate_metrics(run(fp32), run(qdq))
    assert metrics["cosine"] > 0.99, metrics
