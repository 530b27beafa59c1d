"""The accuracy gate: is the new engine close enough to the FP32 model to serve in its place?

Held-out samples (never seen by the calibrator) run through the candidate engine and through the
FP32 model on ONNX Runtime, the reference. Per output, over all held-out samples together:

* relative L2 error ``||cand - ref|| / ||ref||``, and cosine similarity ``<cand, ref> / (|cand||ref|)``
  of the flattened float tensors;
* top-1 agreement for classifier-like outputs: a 2-D float output ``(N, C)`` with ``C >= 2``, the
  share of rows whose arg-max is the same. Only rank 2 counts, because the last axis of a 4-D
  map is its width and an arg-max over it means nothing; a sequence model's ``(N, T, C)`` logits
  are judged by their error and cosine;
* integer or boolean outputs (class ids, counts, masks) cannot be "close": their figure is the
  share of exactly equal elements, reported and gated as top-1 agreement.

Task metrics, computed when ``GateConfig.metric`` names them:

* ``mask_iou``: segmentation or probability maps (a DBNet text map) binarised at ``threshold``;
  the IoU of the two masks over all samples (1.0 when both are empty);
* ``det_f1``: a detector's ``[N, 4 + classes, anchors]`` output decoded into boxes (score
  threshold, NMS; :mod:`edged.quantize.detect`) on both sides; the F1 of the candidate's boxes
  against the reference's at IoU 0.5, counted over all images.

Only the metrics ``GateConfig.metric`` names decide (all of them must pass); each applies to
every output that has the figure. The error and cosine are reported whatever decides. The
reported figures are the worst over the outputs. Non-finite candidate values, missing outputs
and shape changes fail the gate outright.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edged.config import GateConfig
from edged.errors import BuildError
from edged.quantize import detect
from edged.quantize.figures import describe, precision_text

log = logging.getLogger(__name__)

__all__ = ["GateResult", "OutputFigures", "describe", "evaluate", "precision_text"]

RunFn = Callable[[dict[str, np.ndarray]], Mapping[str, np.ndarray]]


@dataclass(frozen=True)
class OutputFigures:
    rel_l2: float | None
    cosine: float | None
    top1: float | None
    mask_iou: float | None = None
    det_f1: float | None = None
    boxes: int | None = None  # det_f1: the reference's boxes (a pass on zero boxes says nothing)

    def to_dict(self) -> dict[str, Any]:
        d = {"rel_l2": _finite(self.rel_l2), "cosine": _finite(self.cosine), "top1": self.top1}
        d.update(
            {
                k: v
                for k, v in (("mask_iou", self.mask_iou), ("det_f1", self.det_f1), ("boxes", self.boxes))
                if v is not None
            }
        )
        return d


@dataclass(frozen=True)
class GateResult:
    rel_l2: float
    cosine: float
    top1: float | None
    passed: bool
    reason: str
    samples: int
    outputs: dict[str, OutputFigures] = field(default_factory=dict)
    mask_iou: float | None = None
    det_f1: float | None = None
    metrics: tuple[str, ...] = ("rel_l2", "cosine", "top1")

    def to_dict(self) -> dict[str, Any]:
        """For the build manifest and the ``/v2/edged`` status."""
        d: dict[str, Any] = {
            "passed": self.passed,
            "reason": self.reason,
            "samples": self.samples,
            "metrics": list(self.metrics),
            "rel_l2": _finite(self.rel_l2),
            "cosine": _finite(self.cosine),
            "top1": self.top1,
        }
        if self.mask_iou is not None:
            d["mask_iou"] = self.mask_iou
        if self.det_f1 is not None:
            d["det_f1"] = self.det_f1
        d["outputs"] = {name: f.to_dict() for name, f in self.outputs.items()}
        return d


def _finite(x: float | None) -> float | str | None:
    # JSON has no inf/nan; a manifest must stay parseable.
    return x if x is None or math.isfinite(x) else str(x)


class _Accumulator:
    """Sums over all samples of one output, so the figures weigh every element equally."""

    def __init__(self, name: str, cfg: GateConfig) -> None:
        self.name = name
        self.cfg = cfg
        self.metrics = cfg.metrics
        self.dot = self.ref_sq = self.cand_sq = self.diff_sq = 0.0
        self.agree = self.rows = 0
        self.is_float: bool | None = None
        self.classifier = True
        self.inter = self.union = 0  # mask_iou
        self.found = self.confirmed = self.ref_boxes = self.cand_boxes = 0  # det_f1
        self.detector = True

    def add(self, ref: np.ndarray, cand: np.ndarray) -> str:
        """Accumulate one pair; a non-empty return is why the candidate fails outright."""
        if cand.shape != ref.shape:
            return f"output '{self.name}' has shape {cand.shape}, the reference {ref.shape}"
        is_float = bool(np.issubdtype(ref.dtype, np.floating))
        self.is_float = is_float if self.is_float is None else self.is_float and is_float
        if not is_float:
            self.agree += int(np.count_nonzero(ref == cand))
            self.rows += ref.size
            return ""
        r = ref.astype(np.float64, copy=False).ravel()
        c = cand.astype(np.float64, copy=False).ravel()
        if not np.all(np.isfinite(c)):
            return f"output '{self.name}' has non-finite values (NaN or inf)"
        self.dot += float(r @ c)
        self.ref_sq += float(r @ r)
        self.cand_sq += float(c @ c)
        self.diff_sq += float((c - r) @ (c - r))
        self.classifier = self.classifier and ref.ndim == 2 and ref.shape[1] >= 2
        if ref.ndim == 2 and ref.shape[1] >= 2:
            self.agree += int(np.count_nonzero(ref.argmax(axis=1) == cand.argmax(axis=1)))
            self.rows += ref.shape[0]
        if "mask_iou" in self.metrics:
            a, b = r > self.cfg.threshold, c > self.cfg.threshold
            self.inter += int(np.count_nonzero(a & b))
            self.union += int(np.count_nonzero(a | b))
        if "det_f1" in self.metrics:
            self._add_detections(ref, cand)
        return ""

    def _add_detections(self, ref: np.ndarray, cand: np.ndarray) -> None:
        self.detector = self.detector and detect.is_yolo_layout(ref.shape)
        if not self.detector:
            return
        low = max(0.0, self.cfg.score_threshold - self.cfg.score_margin)
        for r_img, c_img in zip(ref, cand):
            want = detect.decode_yolo(r_img, low, self.cfg.iou_threshold)
            got = detect.decode_yolo(c_img, low, self.cfg.iou_threshold)
            want_hi = detect.above(want, self.cfg.score_threshold)
            got_hi = detect.above(got, self.cfg.score_threshold)
            # recall: FP32 boxes the candidate found; precision: candidate boxes FP32 confirms.
            # A partner may score up to score_margin under the threshold.
            self.found += detect.match(got, want_hi)
            self.confirmed += detect.match(want, got_hi)
            self.ref_boxes += len(want_hi.boxes)
            self.cand_boxes += len(got_hi.boxes)

    def figures(self) -> OutputFigures:
        if not self.is_float:
            return OutputFigures(None, None, self.agree / self.rows if self.rows else None)
        if self.ref_sq == 0.0:
            rel = 0.0 if self.diff_sq == 0.0 else math.inf
        else:
            rel = math.sqrt(self.diff_sq / self.ref_sq)
        norms = math.sqrt(self.ref_sq) * math.sqrt(self.cand_sq)
        if norms == 0.0:
            cos = 1.0 if self.ref_sq == self.cand_sq else 0.0
        else:
            cos = self.dot / norms
        top1 = self.agree / self.rows if self.classifier and self.rows else None
        iou = (self.inter / self.union if self.union else 1.0) if "mask_iou" in self.metrics else None
        det = "det_f1" in self.metrics and self.detector
        f1 = detect.f1(self.found, self.confirmed, self.ref_boxes, self.cand_boxes) if det else None
        return OutputFigures(rel, cos, top1, iou, f1, self.ref_boxes if det else None)


def _verdict(figs: Mapping[str, OutputFigures], cfg: GateConfig) -> list[str]:
    failures = []
    metrics = cfg.metrics
    for name, f in figs.items():
        if "rel_l2" in metrics and f.rel_l2 is not None and not f.rel_l2 <= cfg.max_rel_l2:
            failures.append(f"'{name}' relative L2 error {f.rel_l2:.4g} > {cfg.max_rel_l2:g}")
        if "cosine" in metrics and f.cosine is not None and not f.cosine >= cfg.min_cosine:
            failures.append(f"'{name}' cosine {f.cosine:.6f} < {cfg.min_cosine:g}")
        if "top1" in metrics and f.top1 is not None and not f.top1 >= cfg.min_top1:
            failures.append(f"'{name}' top-1 agreement {f.top1:.2%} < {cfg.min_top1:.2%}")
        if f.mask_iou is not None and not f.mask_iou >= cfg.min_mask_iou:
            failures.append(f"'{name}' mask IoU at {cfg.threshold:g} {f.mask_iou:.4f} < {cfg.min_mask_iou:g}")
        if f.det_f1 is not None and not f.det_f1 >= cfg.min_det_f1:
            failures.append(f"'{name}' detection F1 {f.det_f1:.4f} < {cfg.min_det_f1:g} ({f.boxes} FP32 boxes)")
    if "det_f1" in metrics and not any(f.det_f1 is not None for f in figs.values()):
        failures.append("no output has the [N, 4 + classes, anchors] layout det_f1 decodes")
    return failures


def _worst(figs: Mapping[str, OutputFigures]) -> dict[str, float | None]:
    def pick(values: list[float | None], fn: Callable[[list[float]], float]) -> float | None:
        present = [v for v in values if v is not None]
        return fn(present) if present else None

    fs = list(figs.values())
    return {
        "rel_l2": pick([f.rel_l2 for f in fs], max) or 0.0,
        "cosine": pick([f.cosine for f in fs], min) if any(f.cosine is not None for f in fs) else 1.0,
        "top1": pick([f.top1 for f in fs], min),
        "mask_iou": pick([f.mask_iou for f in fs], min),
        "det_f1": pick([f.det_f1 for f in fs], min),
    }


def _summary(worst: Mapping[str, float | None], count: int) -> str:
    parts = [f"relative L2 {worst['rel_l2']:.4g}", f"cosine {worst['cosine']:.6f}"]
    if worst["top1"] is not None:
        parts.append(f"top-1 {worst['top1']:.2%}")
    if worst["mask_iou"] is not None:
        parts.append(f"mask IoU {worst['mask_iou']:.4f}")
    if worst["det_f1"] is not None:
        parts.append(f"detection F1 {worst['det_f1']:.4f}")
    return f"{', '.join(parts)} over {count} held-out samples"


def evaluate(
    reference_run: RunFn, candidate_run: RunFn, samples: Iterable[dict[str, np.ndarray]], cfg: GateConfig
) -> GateResult:
    """Run every held-out feed through both and judge the candidate against ``cfg``.

    Raises BuildError when there is nothing to judge (no samples); an exception from either
    runner propagates (the build reports it)."""
    accs: dict[str, _Accumulator] = {}
    count = 0
    for feed in samples:
        ref, cand = reference_run(feed), candidate_run(feed)
        count += 1
        for name, ref_out in ref.items():
            if name not in cand:
                return _failed(f"the candidate has no output '{name}'", count, cfg)
            problem = accs.setdefault(name, _Accumulator(name, cfg)).add(np.asarray(ref_out), np.asarray(cand[name]))
            if problem:
                return _failed(problem, count, cfg)
    if count == 0:
        raise BuildError("accuracy gate: no held-out samples to compare")
    figs = {name: acc.figures() for name, acc in accs.items()}
    worst = _worst(figs)
    failures = _verdict(figs, cfg)
    summary = _summary(worst, count)
    reason = f"failed: {'; '.join(failures)} ({summary})" if failures else f"passed: {summary}"
    log.info("accuracy gate %s", reason if failures else summary)
    return GateResult(
        float(worst["rel_l2"] or 0.0),
        float(worst["cosine"] if worst["cosine"] is not None else 1.0),
        worst["top1"],
        not failures,
        reason,
        count,
        figs,
        worst["mask_iou"],
        worst["det_f1"],
        cfg.metrics,
    )


def _failed(why: str, count: int, cfg: GateConfig) -> GateResult:
    log.info("accuracy gate failed: %s", why)
    return GateResult(math.inf, 0.0, None, False, f"failed: {why}", count, metrics=cfg.metrics)
