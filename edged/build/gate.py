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

Every threshold of ``GateConfig`` applies to every output that has the figure; the reported
figures are the worst over the outputs. Non-finite candidate values, missing outputs and shape
changes fail the gate outright.
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

log = logging.getLogger(__name__)

RunFn = Callable[[dict[str, np.ndarray]], Mapping[str, np.ndarray]]


@dataclass(frozen=True)
class OutputFigures:
    rel_l2: float | None
    cosine: float | None
    top1: float | None


@dataclass(frozen=True)
class GateResult:
    rel_l2: float
    cosine: float
    top1: float | None
    passed: bool
    reason: str
    samples: int
    outputs: dict[str, OutputFigures] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """For the build manifest and the ``/v2/edged`` status."""
        return {
            "passed": self.passed,
            "reason": self.reason,
            "samples": self.samples,
            "rel_l2": _finite(self.rel_l2),
            "cosine": _finite(self.cosine),
            "top1": self.top1,
            "outputs": {
                name: {"rel_l2": _finite(f.rel_l2), "cosine": _finite(f.cosine), "top1": f.top1}
                for name, f in self.outputs.items()
            },
        }


def _finite(x: float | None) -> float | str | None:
    # JSON has no inf/nan; a manifest must stay parseable.
    return x if x is None or math.isfinite(x) else str(x)


class _Accumulator:
    """Sums over all samples of one output, so the figures weigh every element equally."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.dot = self.ref_sq = self.cand_sq = self.diff_sq = 0.0
        self.agree = self.rows = 0
        self.is_float: bool | None = None
        self.classifier = True

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
        return ""

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
        return OutputFigures(rel, cos, top1)


def _verdict(figs: Mapping[str, OutputFigures], cfg: GateConfig) -> list[str]:
    failures = []
    for name, f in figs.items():
        if f.rel_l2 is not None and not f.rel_l2 <= cfg.max_rel_l2:
            failures.append(f"'{name}' relative L2 error {f.rel_l2:.4g} > {cfg.max_rel_l2:g}")
        if f.cosine is not None and not f.cosine >= cfg.min_cosine:
            failures.append(f"'{name}' cosine {f.cosine:.6f} < {cfg.min_cosine:g}")
        if f.top1 is not None and not f.top1 >= cfg.min_top1:
            failures.append(f"'{name}' top-1 agreement {f.top1:.2%} < {cfg.min_top1:.2%}")
    return failures


def _worst(figs: Mapping[str, OutputFigures]) -> tuple[float, float, float | None]:
    rels = [f.rel_l2 for f in figs.values() if f.rel_l2 is not None]
    coss = [f.cosine for f in figs.values() if f.cosine is not None]
    tops = [f.top1 for f in figs.values() if f.top1 is not None]
    return max(rels, default=0.0), min(coss, default=1.0), min(tops, default=None)


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
                return _failed(f"the candidate has no output '{name}'", count)
            problem = accs.setdefault(name, _Accumulator(name)).add(np.asarray(ref_out), np.asarray(cand[name]))
            if problem:
                return _failed(problem, count)
    if count == 0:
        raise BuildError("accuracy gate: no held-out samples to compare")
    figs = {name: acc.figures() for name, acc in accs.items()}
    rel, cos, top1 = _worst(figs)
    failures = _verdict(figs, cfg)
    top1_text = f", top-1 {top1:.2%}" if top1 is not None else ""
    summary = f"relative L2 {rel:.4g}, cosine {cos:.6f}{top1_text} over {count} held-out samples"
    reason = f"failed: {'; '.join(failures)} ({summary})" if failures else f"passed: {summary}"
    log.info("accuracy gate %s", reason if failures else summary)
    return GateResult(rel, cos, top1, not failures, reason, count, figs)


def _failed(why: str, count: int) -> GateResult:
    log.info("accuracy gate failed: %s", why)
    return GateResult(math.inf, 0.0, None, False, f"failed: {why}", count)
