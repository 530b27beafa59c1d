"""Which precision ``precision = "auto"`` serves: the fastest of the candidates that passed the
accuracy gate, where a less precise one has to be faster by a margin.

A pure function of the figures (no numpy, no backend, nothing of edged but the renderings): the
build child calls it with the candidates it built, judged and timed, and the unit tests call it
with figures of their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from edged.quantize.figures import ms_text

# Most precise first: a candidate replaces the one chosen so far only when it is less precise
# and faster by MARGIN.
ORDER = ("fp32", "fp16", "int8")
# A less precise candidate must run at least this much faster to be served: below it the two
# are within what a shared machine's noise moves a median by (the alternated medians of one
# model moved by 1-2% between runs on the 2-core machine), and precision is worth more than a
# difference that may not be there.
MARGIN = 0.03


@dataclass(frozen=True)
class Candidate:
    """One precision as the build found it. ``passed``: it passed its gate (fp32, the
    reference, has none to pass); ``median_ms``: its run at the warm-up shapes, None when it was
    not timed; ``note``: why it is not eligible (its gate's reason, a failed build)."""

    precision: str
    label: str
    passed: bool
    median_ms: float | None
    note: str = ""

    @property
    def eligible(self) -> bool:
        return self.passed and self.median_ms is not None and self.median_ms > 0


@dataclass(frozen=True)
class Choice:
    precision: str
    label: str
    why: str


def _rank(c: Candidate) -> int:
    return ORDER.index(c.precision) if c.precision in ORDER else len(ORDER)


def choose(candidates: Sequence[Candidate], margin: float = MARGIN) -> Choice | None:
    """The candidate to serve, with why; None when no candidate is eligible."""
    eligible = sorted((c for c in candidates if c.eligible), key=_rank)
    if not eligible:
        return None
    best = eligible[0]
    for c in eligible[1:]:
        assert c.median_ms is not None and best.median_ms is not None
        if c.median_ms <= best.median_ms * (1.0 - margin):
            best = c
    assert best.median_ms is not None
    reasons = [_against(best, c, margin) for c in sorted(candidates, key=_rank) if c is not best]
    why = f"{best.label} {ms_text(best.median_ms)}" + (": " + "; ".join(reasons) if reasons else "")
    return Choice(best.precision, best.label, why)


def _against(best: Candidate, other: Candidate, margin: float) -> str:
    """Why ``other`` is not served instead of ``best``."""
    if not other.eligible:
        return f"{other.label} {other.note or 'was not timed'}"
    assert best.median_ms is not None and other.median_ms is not None
    gain = 1.0 - best.median_ms / other.median_ms
    if _rank(other) < _rank(best):  # more precise: best beat it by the margin
        return f"{gain:.1%} faster than {other.label} ({ms_text(other.median_ms)})"
    if other.median_ms < best.median_ms:  # less precise and faster, within the margin
        lead = 1.0 - other.median_ms / best.median_ms
        return f"{other.label} {ms_text(other.median_ms)} is {lead:.1%} faster, under the {margin:.0%} margin"
    return f"{other.label} is slower ({ms_text(other.median_ms)})"
