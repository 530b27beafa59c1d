"""The Jetson self-test's parts that run anywhere: its report without TensorRT, its Q/DQ recipe,
its synthetic data and its gate metrics."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from edged.backends.tensorrt.versions import read_model_traits
from edged.config import GateConfig, from_mapping
from edged.tools import selftest, selftest_checks
from edged.tools.selftest import gate_metrics, run_selftest, selftest_qdq, synthetic_feeds
from edged.tools.selftest_checks import Check, _figures, demo_model
from tests.helpers import tensorrt_installed


@pytest.mark.skipif(tensorrt_installed(), reason="TensorRT is installed here: the selftest runs its checks")
def test_without_tensorrt_the_report_says_why_and_exits_2() -> None:
    out = io.StringIO()
    assert run_selftest(None, out) == 2
    lines = out.getvalue().splitlines()
    keys = [line.split(":")[0].strip() for line in lines[1:]]
    assert keys == ["platform", "memory", "tensorrt", "model", "int8", "instances", "buffers", "cold start", "result"]
    assert lines[3].startswith("tensorrt    : NOT USABLE: tensorrt")
    assert all(line.endswith("NOT RUN: needs TensorRT") for line in lines[5:9])
    assert lines[-1] == "result      : ERROR: the TensorRT backend is not usable here"


def test_a_missing_config_is_reported_not_raised(tmp_path: Path) -> None:
    out = io.StringIO()
    assert run_selftest(str(tmp_path / "nope.toml"), out) == 2
    assert "cannot read config" in out.getvalue()


def fake_checks(monkeypatch: pytest.MonkeyPatch, checks: list[Check]) -> None:
    """Fakes for the pure result logic: TensorRT 'usable' and the checks' verdicts given."""
    monkeypatch.setattr(selftest, "_platform", lambda report, cfg: True)
    monkeypatch.setattr(selftest, "_exercise", lambda report, demo, tmp: [report.check(c) for c in checks])


@pytest.mark.parametrize(
    "statuses, code, result",
    [
        (["PASS", "PASS", "PASS"], 0, "PASS (3 checks passed)"),
        (["PASS", "PASS", "SKIP"], 0, "PASS (2 checks passed; skipped: c)"),
        (["FAIL", "PASS", "PASS"], 1, "FAIL: a (2 of 3 checks passed)"),
        (["PASS", "FAIL", "SKIP"], 1, "FAIL: b (1 of 2 checks passed)"),
    ],
)
def test_pass_only_for_what_passed(
    monkeypatch: pytest.MonkeyPatch, statuses: list[str], code: int, result: str
) -> None:
    fake_checks(monkeypatch, [Check(name, st, "detail") for name, st in zip("abc", statuses)])
    out = io.StringIO()
    assert run_selftest(None, out) == code
    text = out.getvalue()
    assert text.splitlines()[-1] == f"result      : {result}"
    assert f"a           : detail -> {statuses[0]}" in text


def test_the_demo_is_the_configured_model_built_as_the_daemon_would(tmp_path: Path) -> None:
    from edged.tools.demo import make_tiny_mlp

    model = make_tiny_mlp(tmp_path / "m.onnx")
    cfg = from_mapping(
        {
            "models": {
                "gone": {"path": str(tmp_path / "gone.onnx")},
                "mine": {"path": str(model), "profiles": {"x": {"min": [1, 16], "opt": [2, 16], "max": [4, 16]}}},
            }
        }
    )
    demo = demo_model(cfg, tmp_path)
    assert demo.path == model and "mine" in demo.origin
    assert (demo.model.backend, demo.model.precision) == ("tensorrt", "int8")
    assert demo.model.profiles["x"].opt == [2, 16]
    assert demo.model.calibration is not None and "synthetic" in demo.data_note
    samples = list(Path(demo.model.calibration.data).glob("*.npz"))
    assert len(samples) == 40
    with np.load(samples[0]) as z:
        assert z["x"].shape == (2, 16)


def test_the_demo_detector_is_judged_on_rendered_text_by_its_mask(
    tmp_path: Path, demo_models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Synthetic strokes would give the detector nothing to find, so its INT8 error would be
    judged on noise. Rendered text pages, through the daemon's image loader, give FP32 a text
    mask to compare against. The detector is the demo's (``demo_models``: data/models/ when
    scripts/demo.sh has set it up, else extracted from its wheel), where the selftest looks."""
    import onnxruntime as ort

    from edged.backends.base import TensorSpec
    from edged.quantize.calibrate import CalibrationSet

    monkeypatch.setattr(selftest_checks, "DEMO", demo_models)
    demo = demo_model(from_mapping({}), tmp_path)
    assert demo.origin == "demo detector" and demo.model.calibration is not None
    if "metric" in GateConfig.__struct_fields__:  # the task-aware gate
        assert demo.model.gate.metric == "mask_iou"  # type: ignore[attr-defined]
    samples = CalibrationSet.load(demo.model.calibration, [TensorSpec("x", "float32", (-1, 3, -1, -1))])
    assert len(samples) == 40
    feed = next(iter(samples))
    assert feed["x"].shape == (1, 3, 640, 640)
    sess = ort.InferenceSession(str(demo_models), providers=["CPUExecutionProvider"])
    text = float((sess.run(None, feed)[0] > 0.3).mean())
    assert text > 0.01, f"FP32 finds text on {text:.2%} of the page"


def test_figures_name_the_task_metric_first() -> None:
    gate = {"mask_iou": 0.9231, "rel_l2": 0.51, "cosine": 0.87, "top1": None, "passed": False}
    assert _figures(gate) == "mask_iou 0.9231, rel_l2 0.51, cosine 0.87"
    assert _figures({}) == "no figures"


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

    from edged.tools.demo import make_tiny_mlp

    fp32 = make_tiny_mlp(tmp_path / "tiny.onnx")
    feeds = synthetic_feeds([("x", (4, 16), "float32")], 16, seed=1)
    qdq = selftest_qdq(fp32, tmp_path / "tiny.qdq.onnx", feeds)
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


def test_a_configured_ocr_det_keeps_its_tensorrt_options_and_gets_the_demo_data(
    tmp_path: Path, demo_models: Path
) -> None:
    static = {"min": [1, 3, 640, 640], "opt": [1, 3, 640, 640], "max": [1, 3, 640, 640]}
    model = {
        "path": str(demo_models),
        "profiles": {"x": static},
        "tensorrt": {"dla_core": 0, "legacy_calibrator": True},
    }
    demo = demo_model(from_mapping({"models": {"ocr_det": model}}), tmp_path)
    assert demo.origin == "config model 'ocr_det'" and "rendered text pages" in demo.data_note
    assert demo.model.tensorrt.dla_core == 0 and demo.model.tensorrt.legacy_calibrator
    assert demo.model.profiles["x"].max == [1, 3, 640, 640]
    assert demo.model.calibration is not None and demo.model.calibration.resize == [640, 640]


def test_the_build_note_names_dla_fallback_and_the_float_parts() -> None:
    from edged.tools.selftest_checks import _build_note

    manifest = {
        "strongly_typed": True,
        "fp16": {"fp16_nodes": 687, "fp32_nodes": 19},
        "dla_core": 0,
        "dla_gpu_fallback": {"layers": ["resize_1", "sigmoid"], "count": 2, "of": 90},
    }
    assert _build_note(manifest) == (
        "strongly typed, float parts FP16 (687 nodes; 19 kept FP32), DLA core 0: 2 of 90 layers on the GPU "
        "(resize_1, sigmoid)"
    )
    assert _build_note({"builder_flags": ["INT8", "FP16"], "legacy_calibrator": True, "calibration_samples": 32}) == (
        "flags INT8+FP16, legacy calibrator on 32 samples"
    )


def test_a_failed_int8_build_is_a_fail_and_the_other_checks_still_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fakes for the pure control flow: TensorRT 'usable', the int8 build raising as a TensorRT
    build error would, the instances check passing."""
    from edged.errors import BuildError

    def failing_build(demo: object, tmp: object, say: object) -> None:
        raise BuildError("TensorRT could not build the engine: out of memory")

    monkeypatch.setattr(selftest, "_platform", lambda report, cfg: True)
    monkeypatch.setattr(selftest, "int8_check", failing_build)
    monkeypatch.setattr(selftest, "instances_check", lambda tmp: Check("instances", "PASS", "3 instances"))
    out = io.StringIO()
    assert run_selftest(None, out) == 1
    text = out.getvalue()
    assert "int8        : the build failed: TensorRT could not build the engine: out of memory -> FAIL" in text
    assert "instances   : 3 instances -> PASS" in text
    assert "buffers     : no engine was built -> SKIP" in text
    assert text.splitlines()[-1] == "result      : FAIL: int8 (1 of 2 checks passed)"
