"""Detections from a detector's raw output, and how well one set of boxes matches another.

The accuracy gate's ``det_f1`` metric decodes the FP32 and the INT8 outputs the same way and asks
how many INT8 boxes find an FP32 box of the same class at IoU >= 0.5 (precision) and how many FP32
boxes find an INT8 one (recall). With ``score_margin`` > 0 the partner may score that much under
the threshold: a box whose score moved from 0.26 to 0.24 is then not counted as a disagreement. The decoder reads the
YOLOv8 layout ``[N, 4 + classes, anchors]``: per anchor a box ``(cx, cy, w, h)`` and one score per
class (already a probability; v8 has no objectness). Boxes under ``score_threshold`` are dropped,
then NMS per class at ``iou_threshold`` (what ultralytics does before it reports boxes).

Every cost is bounded: at most ``MAX_CANDIDATES`` boxes per image enter NMS, at most ``MAX_DET``
leave it, so a degenerate model that scores every anchor high costs the same as a good one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_CANDIDATES = 3000  # highest-scoring boxes per image that enter NMS
MAX_DET = 300  # boxes per image after NMS (ultralytics' default max_det)
MATCH_IOU = 0.5


@dataclass(frozen=True)
class Detections:
    boxes: np.ndarray  # [K, 4] x1, y1, x2, y2
    scores: np.ndarray  # [K]
    classes: np.ndarray  # [K] int


def is_yolo_layout(shape: tuple[int, ...]) -> bool:
    """[N, 4 + classes, anchors] with at least one class and more anchors than channels."""
    return len(shape) == 3 and shape[1] >= 5 and shape[2] > shape[1]


def iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every box in ``a`` [K, 4] with every box in ``b`` [M, 4] (x1, y1, x2, y2)."""
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(rb - lt, 0.0, None), axis=2)
    area_a = np.prod(np.clip(a[:, 2:] - a[:, :2], 0.0, None), axis=1)
    area_b = np.prod(np.clip(b[:, 2:] - b[:, :2], 0.0, None), axis=1)
    union = area_a[:, None] + area_b[None, :] - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1.0), 0.0)


def nms(boxes: np.ndarray, scores: np.ndarray, iou_threshold: float) -> np.ndarray:
    """Indices kept by greedy NMS, best first (at most MAX_DET)."""
    order = np.argsort(-scores, kind="stable")
    keep: list[int] = []
    while order.size and len(keep) < MAX_DET:
        best = int(order[0])
        keep.append(best)
        rest = order[1:]
        order = rest[iou_matrix(boxes[best : best + 1], boxes[rest])[0] <= iou_threshold]
    return np.asarray(keep, dtype=np.int64)


def decode_yolo(pred: np.ndarray, score_threshold: float, iou_threshold: float) -> Detections:
    """One image's detections from its [4 + classes, anchors] slice."""
    pred = np.asarray(pred, dtype=np.float32)
    scores_all = pred[4:]
    classes = scores_all.argmax(axis=0)
    scores = scores_all.max(axis=0)
    idx = np.flatnonzero(scores >= score_threshold)
    if idx.size > MAX_CANDIDATES:
        idx = idx[np.argsort(-scores[idx], kind="stable")[:MAX_CANDIDATES]]
    cx, cy, w, h = pred[0, idx], pred[1, idx], pred[2, idx], pred[3, idx]
    boxes = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=1)
    scores, classes = scores[idx], classes[idx]
    # Per-class NMS in one pass: boxes of different classes are moved apart so they never overlap.
    offset = classes[:, None].astype(np.float32) * (float(np.abs(boxes).max(initial=0.0)) * 2 + 1)
    keep = nms(boxes + offset, scores, iou_threshold)
    return Detections(boxes[keep], scores[keep], classes[keep])


def match(reference: Detections, candidate: Detections, iou: float = MATCH_IOU) -> int:
    """True positives: candidate boxes (best first) that claim an unclaimed reference box of the
    same class with IoU >= ``iou``."""
    if not len(reference.boxes) or not len(candidate.boxes):
        return 0
    overlap = iou_matrix(candidate.boxes, reference.boxes)
    overlap[candidate.classes[:, None] != reference.classes[None, :]] = 0.0
    claimed = np.zeros(len(reference.boxes), dtype=bool)
    hits = 0
    for i in np.argsort(-candidate.scores, kind="stable"):
        row = np.where(claimed, 0.0, overlap[i])
        j = int(row.argmax())
        if row[j] >= iou:
            claimed[j] = True
            hits += 1
    return hits


def above(dets: Detections, score: float) -> Detections:
    """The detections scoring at least ``score`` (greedy NMS keeps the same high boxes whatever
    the lower threshold was, so decoding once at the lower one and filtering is exact)."""
    keep = dets.scores >= score
    return Detections(dets.boxes[keep], dets.scores[keep], dets.classes[keep])


def f1(found: int, confirmed: int, n_reference: int, n_candidate: int) -> float:
    """F1 of the candidate's boxes against the reference's: recall = found / reference boxes,
    precision = confirmed / candidate boxes. 1.0 when neither has a box, 0.0 when one has none."""
    if n_reference == 0 and n_candidate == 0:
        return 1.0
    if n_reference == 0 or n_candidate == 0:
        return 0.0
    recall, precision = found / n_reference, confirmed / n_candidate
    return 0.0 if recall + precision == 0 else 2 * recall * precision / (recall + precision)
