"""The task-aware gate metrics on constructed cases: a known mask IoU, a known detection F1, the
YOLOv8 decoder's score threshold and per-class NMS, and metrics combined (all must pass)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec
import numpy as np
import pytest

from edged.config import GateConfig
from edged.quantize import detect
from edged.quantize.gate import RunFn, evaluate

Feed = dict[str, np.ndarray]


def gate(**kw: object) -> GateConfig:
    return msgspec.convert(kw, GateConfig)


def fixed(outputs: Mapping[str, np.ndarray]) -> RunFn:
    return lambda feed: outputs


# --- mask IoU ------------------------------------------------------------------------------------


def maps() -> tuple[np.ndarray, np.ndarray]:
    """Reference: 100 pixels above 0.3. Candidate: 50 of them plus 50 others, and values that
    differ from the reference below the threshold (which must not count)."""
    ref = np.full((1, 1, 20, 20), 0.1, np.float32)
    cand = np.full((1, 1, 20, 20), 0.25, np.float32)
    ref[0, 0, 0:5, :] = 0.9  # rows 0-4: 100 pixels
    cand[0, 0, 0:5, 0:10] = 0.6  # 50 of them
    cand[0, 0, 10:15, 0:10] = 0.31  # 50 new ones, just above the threshold
    return ref, cand


def test_mask_iou_is_known_and_gated() -> None:
    ref, cand = maps()
    result = evaluate(fixed({"map": ref}), fixed({"map": cand}), [{}], gate(metric="mask_iou", min_mask_iou=0.3))
    assert result.mask_iou == pytest.approx(50 / 150)
    assert result.passed and result.metrics == ("mask_iou",)
    strict = evaluate(fixed({"map": ref}), fixed({"map": cand}), [{}], gate(metric="mask_iou"))
    assert not strict.passed and "mask IoU at 0.3 0.3333 < 0.95" in strict.reason
    # the relative error is still reported, but does not decide
    assert strict.rel_l2 > 0.05 and "relative L2 error" not in strict.reason
    assert strict.to_dict()["mask_iou"] == pytest.approx(1 / 3)


def test_mask_threshold_is_configurable_and_counts_all_samples() -> None:
    ref, cand = maps()
    # at 0.5 the 0.31 pixels drop out: 50 / 100
    result = evaluate(fixed({"map": ref}), fixed({"map": cand}), [{}, {}], gate(metric="mask_iou", threshold=0.5))
    assert result.mask_iou == pytest.approx(0.5) and result.samples == 2
    empty = np.zeros((1, 1, 4, 4), np.float32)
    both_empty = evaluate(fixed({"map": empty}), fixed({"map": empty}), [{}], gate(metric="mask_iou"))
    assert both_empty.mask_iou == 1.0 and both_empty.passed


# --- detection F1 ----------------------------------------------------------------------------------


def yolo(
    boxes: Sequence[tuple[float, float, float, float, int, float]], classes: int = 3, anchors: int = 64
) -> np.ndarray:
    """A [1, 4 + classes, anchors] output holding ``boxes`` (cx, cy, w, h, class, score); the other
    anchors score 0.01, below any threshold."""
    out = np.zeros((1, 4 + classes, anchors), np.float32)
    out[0, 4:, :] = 0.01
    out[0, :4, :] = 5.0
    for i, (cx, cy, w, h, cls, score) in enumerate(boxes):
        out[0, :4, i] = (cx, cy, w, h)
        out[0, 4 + cls, i] = score
    return out


REF_BOXES = [
    (50, 50, 20, 20, 0, 0.9),
    (150, 50, 30, 30, 1, 0.8),
    (50, 150, 40, 20, 2, 0.7),
    (150, 150, 20, 40, 0, 0.6),
]


def test_detection_f1_is_known() -> None:
    cand = [
        (51, 50, 20, 20, 0, 0.85),  # IoU ~0.90 with the first: a hit
        (150, 52, 30, 30, 1, 0.8),  # a hit
        (50, 150, 40, 20, 1, 0.7),  # right place, wrong class: a miss
        (250, 250, 20, 20, 0, 0.5),  # nothing there: a false positive
        (158, 150, 20, 40, 0, 0.1),  # under the score threshold: not a detection
    ]
    cfg = gate(metric="det_f1", min_det_f1=0.5)
    result = evaluate(fixed({"out": yolo(REF_BOXES)}), fixed({"out": yolo(cand)}), [{}], cfg)
    # 2 hits, 4 reference boxes, 4 candidate boxes: F1 = 2 * 2 / (4 + 4)
    assert result.det_f1 == pytest.approx(0.5) and result.passed
    assert result.outputs["out"].boxes == 4
    strict = evaluate(fixed({"out": yolo(REF_BOXES)}), fixed({"out": yolo(cand)}), [{}], gate(metric="det_f1"))
    assert not strict.passed and "detection F1 0.5000 < 0.95 (4 FP32 boxes)" in strict.reason


def test_identical_detections_pass_and_nms_is_per_class() -> None:
    boxes = [*REF_BOXES, (52, 50, 20, 20, 0, 0.5), (52, 50, 20, 20, 1, 0.5)]
    dets = detect.decode_yolo(yolo(boxes)[0], 0.25, 0.45)
    # the overlapping box of the same class is suppressed, the one of another class is kept
    assert len(dets.boxes) == 5 and sorted(dets.classes.tolist()) == [0, 0, 1, 1, 2]
    result = evaluate(fixed({"out": yolo(boxes)}), fixed({"out": yolo(boxes)}), [{}], gate(metric="det_f1"))
    assert result.det_f1 == 1.0 and result.passed


def test_det_f1_needs_a_detector_layout() -> None:
    logits = {"logits": np.ones((2, 5), np.float32)}
    result = evaluate(fixed(logits), fixed(logits), [{}], gate(metric="det_f1"))
    assert not result.passed and "[N, 4 + classes, anchors]" in result.reason


def test_iou_matrix_known_values() -> None:
    a = np.array([[0, 0, 10, 10]], np.float32)
    b = np.array([[5, 0, 15, 10], [20, 20, 30, 30], [0, 0, 10, 10]], np.float32)
    assert detect.iou_matrix(a, b)[0] == pytest.approx([50 / 150, 0.0, 1.0])


def test_decoder_cost_is_bounded() -> None:
    # every anchor scores high and nothing overlaps: at most MAX_DET boxes come out
    anchors = 5000
    out = np.zeros((4 + 1, anchors), np.float32)
    out[0] = np.arange(anchors) * 10.0
    out[1], out[2], out[3], out[4] = 5.0, 4.0, 4.0, 0.9
    assert len(detect.decode_yolo(out, 0.25, 0.45).boxes) == detect.MAX_DET


# --- combined ----------------------------------------------------------------------------------------


def test_combined_metrics_must_all_pass() -> None:
    ref, cand = maps()
    cfg = gate(metric=["mask_iou", "cosine"], min_mask_iou=0.3, min_cosine=0.999)
    result = evaluate(fixed({"map": ref}), fixed({"map": cand}), [{}], cfg)
    assert result.mask_iou == pytest.approx(1 / 3) and not result.passed
    assert "cosine" in result.reason and "mask IoU" not in result.reason.split("(")[0]
    loose = gate(metric=["mask_iou", "cosine"], min_mask_iou=0.3, min_cosine=0.5)
    assert evaluate(fixed({"map": ref}), fixed({"map": cand}), [{}], loose).passed


def test_unknown_metric_is_a_config_error() -> None:
    with pytest.raises(msgspec.ValidationError, match=r"\$\.metric"):
        gate(metric="f1")


def test_describe_and_precision_text_show_the_mixed_result() -> None:
    from edged.quantize.gate import describe, precision_text

    gate_dict = {
        "passed": True,
        "rel_l2": 0.15,
        "cosine": 0.988,
        "mask_iou": 0.9647,
        "search": {"passed": True, "excluded": ["a", "b"], "int8_mac_fraction": 0.868, "trials": [{}, {}]},
    }
    assert describe(gate_dict) == "pass rel_l2=0.15 cosine=0.988 mask_iou=0.9647 mixed: 2 nodes float, 87% MACs int8"
    assert precision_text("int8", gate_dict) == "int8 (mixed)"
    missed = dict(gate_dict, passed=False, search={"passed": False, "excluded": [], "trials": [{}] * 8})
    assert describe(missed).endswith("mixed: no pass in 8 trials") and precision_text("int8", missed) == "int8"
    assert describe(None) == "-" and precision_text(None, None) == "-"


def test_search_settings_are_validated() -> None:
    assert gate().search == "auto" and gate().max_trials == 8
    with pytest.raises(msgspec.ValidationError, match=r"\$\.search"):
        gate(search="always")
    with pytest.raises(msgspec.ValidationError, match=r"\$\.max_trials"):
        gate(max_trials=0)


def test_score_margin_forgives_boxes_that_only_crossed_the_threshold() -> None:
    cand = [*REF_BOXES[:3], (150, 150, 20, 40, 0, 0.22)]  # the 4th box scores 0.22, just under 0.25
    exact = evaluate(fixed({"out": yolo(REF_BOXES)}), fixed({"out": yolo(cand)}), [{}], gate(metric="det_f1"))
    assert exact.det_f1 == pytest.approx(2 * 3 / (4 + 3))  # recall 3/4, precision 3/3
    cfg = gate(metric="det_f1", score_margin=0.05)
    forgiving = evaluate(fixed({"out": yolo(REF_BOXES)}), fixed({"out": yolo(cand)}), [{}], cfg)
    assert forgiving.det_f1 == 1.0 and forgiving.passed
    # a box far under the threshold is still a miss
    far = [*REF_BOXES[:3], (150, 150, 20, 40, 0, 0.1)]
    assert evaluate(fixed({"out": yolo(REF_BOXES)}), fixed({"out": yolo(far)}), [{}], cfg).det_f1 == pytest.approx(
        6 / 7
    )
