"""The accuracy gate: figures, verdicts and reasons, with synthetic runners and real ORT."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edged.config import GateConfig
from edged.errors import BuildError
from edged.quantize.gate import GateResult, evaluate

Feed = dict[str, np.ndarray]
Run = Callable[[Feed], Mapping[str, np.ndarray]]

RNG = np.random.default_rng(11)
FEEDS = [{"x": RNG.standard_normal((10, 4)).astype(np.float32)} for _ in range(3)]
W = RNG.standard_normal((4, 6)).astype(np.float32)


def classifier(feed: Feed) -> dict[str, np.ndarray]:
    return {"logits": feed["x"] @ W}


def scaled_noise(level: float) -> Run:
    rng = np.random.default_rng(5)

    def run(feed: Feed) -> dict[str, np.ndarray]:
        y = classifier(feed)["logits"]
        noise = rng.standard_normal(y.shape).astype(np.float32)
        return {"logits": y + level * noise * np.linalg.norm(y) / np.linalg.norm(noise)}

    return run


def test_identical_runs_pass_with_perfect_figures() -> None:
    result = evaluate(classifier, classifier, FEEDS, GateConfig())
    assert result.passed and result.samples == 3
    assert result.rel_l2 == 0.0 and result.cosine == pytest.approx(1.0) and result.top1 == 1.0
    assert result.reason.startswith("passed: relative L2 0, cosine 1.000000, top-1 100.00%")
    assert "over 3 held-out samples" in result.reason


def test_relative_error_and_cosine_are_measured_and_gated() -> None:
    result = evaluate(classifier, scaled_noise(0.1), FEEDS, GateConfig(min_top1=0.0))
    assert result.rel_l2 == pytest.approx(0.1, rel=0.05)  # the noise was 10% of each batch
    assert result.cosine == pytest.approx(1 / math.sqrt(1 + 0.1**2), abs=0.01)
    assert not result.passed
    assert "'logits' relative L2 error 0.1" in result.reason and "> 0.05" in result.reason
    loose = evaluate(classifier, scaled_noise(0.1), FEEDS, GateConfig(max_rel_l2=0.2, min_cosine=0.9, min_top1=0.0))
    assert loose.passed, loose.reason


def test_top1_agreement_counts_rows_whose_argmax_changed() -> None:
    def one_flip(feed: Feed) -> dict[str, np.ndarray]:
        y = classifier(feed)["logits"].copy()
        if feed is FEEDS[0]:
            row = y[0]
            row[row.argmin()] = row.max() + 1.0  # a new winner in one row of 30
        return {"logits": y}

    strict = GateConfig(max_rel_l2=1.0, min_cosine=0.0, min_top1=0.99)
    result = evaluate(classifier, one_flip, FEEDS, strict)
    assert result.top1 == pytest.approx(29 / 30)
    assert not result.passed and "top-1 agreement 96.67% < 99.00%" in result.reason
    lenient = GateConfig(max_rel_l2=1.0, min_cosine=0.0, min_top1=0.95)
    assert evaluate(classifier, one_flip, FEEDS, lenient).passed


def test_maps_and_sequences_have_no_top1() -> None:
    def maps(feed: Feed) -> dict[str, np.ndarray]:
        x = feed["x"]
        return {
            "map": np.tile(x[:, None, None, :], (1, 1, 3, 1)),  # (N, 1, 3, 4)
            "seq": np.stack([x, x], axis=1),
        }  # (N, T, C)

    result = evaluate(maps, maps, FEEDS, GateConfig())
    assert result.top1 is None and result.passed
    assert {n: f.top1 for n, f in result.outputs.items()} == {"map": None, "seq": None}
    assert "top-1" not in result.reason


def test_integer_outputs_are_judged_by_exact_agreement() -> None:
    def labels(feed: Feed) -> dict[str, np.ndarray]:
        return {"ids": classifier(feed)["logits"].argmax(axis=1)}

    def off_by_one(feed: Feed) -> dict[str, np.ndarray]:
        ids = labels(feed)["ids"].copy()
        ids[:5] += 1
        return {"ids": ids}

    result = evaluate(labels, off_by_one, FEEDS, GateConfig())
    figs = result.outputs["ids"]
    assert figs.rel_l2 is None and figs.cosine is None and figs.top1 == pytest.approx(0.5)
    assert not result.passed and "'ids' top-1 agreement 50.00%" in result.reason


def test_worst_output_decides() -> None:
    def two(feed: Feed) -> dict[str, np.ndarray]:
        return {"a": classifier(feed)["logits"], "b": feed["x"]}

    def b_off(feed: Feed) -> dict[str, np.ndarray]:
        return {"a": classifier(feed)["logits"], "b": feed["x"] * 1.5}

    result = evaluate(two, b_off, FEEDS, GateConfig())
    assert result.outputs["a"].rel_l2 == 0.0
    assert result.rel_l2 == pytest.approx(0.5) and not result.passed
    assert "'b' relative L2 error 0.5 > 0.05" in result.reason and "'a'" not in result.reason


@pytest.mark.parametrize(
    ("candidate", "message"),
    [
        (lambda f: {"logits": np.full((10, 6), np.nan, np.float32)}, "non-finite values"),
        (lambda f: {"other": classifier(f)["logits"]}, "the candidate has no output 'logits'"),
        (lambda f: {"logits": classifier(f)["logits"][:, :5]}, r"has shape \(10, 5\)"),
    ],
)
def test_broken_candidates_fail_outright(candidate: Run, message: str) -> None:
    result = evaluate(classifier, candidate, FEEDS, GateConfig())
    assert not result.passed and result.reason.startswith("failed: ")
    assert re.search(message, result.reason), result.reason
    json.dumps(result.to_dict())  # inf figures stay valid JSON


def test_zero_reference_and_no_samples() -> None:
    def zeros(feed: Feed) -> dict[str, np.ndarray]:
        return {"y": np.zeros((2, 3), np.float32)}

    def ones(feed: Feed) -> dict[str, np.ndarray]:
        return {"y": np.ones((2, 3), np.float32)}

    same = evaluate(zeros, zeros, FEEDS[:1], GateConfig())
    assert same.passed and same.rel_l2 == 0.0 and same.cosine == 1.0
    differ = evaluate(zeros, ones, FEEDS[:1], GateConfig())
    assert not differ.passed and math.isinf(differ.rel_l2)
    assert differ.to_dict()["rel_l2"] == "inf"
    with pytest.raises(BuildError, match="no held-out samples"):
        evaluate(zeros, zeros, [], GateConfig())


# --- with ONNX Runtime ------------------------------------------------------------------------


def _model(path: Path, w: np.ndarray) -> Path:
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["logits"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 6])],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _runner(path: Path) -> Run:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return lambda feed: dict(zip(names, sess.run(names, feed)))


def test_real_sessions(tmp_path: Path) -> None:
    ref = _runner(_model(tmp_path / "ref.onnx", W))
    same = evaluate(ref, _runner(_model(tmp_path / "same.onnx", W.copy())), FEEDS, GateConfig())
    assert same.passed and same.rel_l2 < 1e-6 and same.top1 == 1.0
    skewed = W.copy()
    skewed[:, 0] += 3.0  # column 0 now wins most rows
    worse = evaluate(ref, _runner(_model(tmp_path / "skew.onnx", skewed)), FEEDS, GateConfig())
    assert isinstance(worse, GateResult) and not worse.passed
    assert worse.top1 is not None and worse.top1 < 0.9 and worse.rel_l2 > 0.1
