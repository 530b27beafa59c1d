"""Whether dynamic batching can help a model, measured at warm-up.

A batch pays when its run costs less than the single runs it replaces. That holds for a model
that streams its weights once per run (an MLP's GEMV at batch 1 becomes a GEMM; the mlp2k
benchmark model runs 16 rows in about the time of 3 single runs on the 2-core machine), and
for a GPU engine whose kernels are underused by one row. It does not hold for a conv net on a
small CPU: its batch of 8 frames costs as much as 8 single runs or more (the cache holds one
frame's activations, not eight), and the batch adds the copy that joins the requests' inputs.

So at warm-up, on a worker thread, single runs are alternated with batched runs of a few sizes
(2, 4, 8 ... up to ``max_batch``, and the preferred sizes), each batched run timed with the
``np.concatenate`` that joins its rows, as the scheduler does. A size helps when a row runs at
least MARGIN times faster in it than alone, read both as the median over its pairs and as the
ratio of the two sides' lower quartiles; a batch may hold at most
the largest size that helps, and a model that no size helps runs unbatched. The status says
which, with the figures.

The measurement is bounded: at least MIN_PAIRS alternated pairs per size, at most MAX_PAIRS, all
within a budget of the larger of BUDGET_US and BUDGET_RUNS single runs (so a slow model still
gets its batch of 2 measured), and never more than CAP_US; a size whose projected pairs do not
fit what is left, or whose joined inputs pass MAX_BATCH_BYTES, is not measured, nor any larger.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edged.serving.warmup import run_cost_us, timed_us

log = logging.getLogger(__name__)

# A batch must cut a row's cost by at least this factor to be worth forming: below it, what a
# batch saves is within what the shared machines' noise moves a run by, and the batch's copies
# and a request's wait behind its company are not worth it.
MARGIN = 1.15
MIN_PAIRS = 5
MAX_PAIRS = 12
BUDGET_US = 300_000.0
BUDGET_RUNS = 20.0  # single runs' worth of budget, where that is more than BUDGET_US
CAP_US = 2_000_000.0
MAX_BATCH_BYTES = 64 << 20  # one batched run's joined inputs

Inputs = Mapping[str, np.ndarray]


# Per batch size, the alternated (single run, batched run) pairs measured, in microseconds.
Pairs = Mapping[int, Sequence[tuple[float, float]]]


@dataclass(frozen=True)
class BatchFit:
    """``rows``: the most rows a formed batch holds (1: every request runs alone); ``measured``:
    whether ``rows`` comes from the figures (otherwise it is the configuration's, and ``reason``
    says why); ``runs_us``: one run's cost per batch size (1: a single run), lower quartiles;
    ``gains``: per batch size, how many times faster a row runs in it than alone."""

    rows: int
    reason: str
    measured: bool = False
    runs_us: dict[int, float] = field(default_factory=dict)
    gains: dict[int, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "on": self.rows > 1,
            "rows": self.rows,
            "measured": self.measured,
            "reason": self.reason,
            "runs_us": {str(n): round(us, 1) for n, us in sorted(self.runs_us.items())},
            "gains": {str(n): round(g, 3) for n, g in sorted(self.gains.items())},
        }


def sizes(max_batch: int, preferred: Sequence[int] = ()) -> list[int]:
    """The batch sizes to measure, smallest first: powers of two below ``max_batch``, the
    preferred sizes, and ``max_batch`` itself."""
    out = {n for n in preferred if 1 < n <= max_batch}
    n = 2
    while n < max_batch:
        out.add(n)
        n *= 2
    if max_batch > 1:
        out.add(max_batch)
    return sorted(out)


def decide(pairs: Pairs, max_batch: int, margin: float = MARGIN) -> BatchFit:
    """The batch limit from measured pairs. A size's gain is the lower of two readings: the median
    over its pairs of ``n * single / batched`` (a pair's two runs are adjacent, so a busy moment of
    a shared host falls on both: on the 2-core machine under a load of 5-7, single runs of 0.4 ms
    read 1.5-3.8 ms) and ``n`` times the ratio of the two sides' lower quartiles (each side's own
    cost, which the pairs' median can overstate when the single runs of a few pairs were slow).
    Pure: the unit tests feed it figures."""
    measured = {n: p for n, p in pairs.items() if n > 1 and p}
    if not measured:
        return BatchFit(max_batch, "not measured: no batch fitted the warm-up's time budget")
    runs = {n: run_cost_us([b for _, b in p]) for n, p in measured.items()}
    runs[1] = run_cost_us([s for p in measured.values() for s, _ in p])
    # Both readings must agree that a size helps: the median of the pairs' ratios (a busy moment
    # falls on both runs of a pair) and the ratio of the two sides' lower quartiles (each side's own
    # cost). On the 16-core host a conv's batch of 2 read 1.18x by the first and 0.87x by the second
    # (3312 us against 1447 us), and batching it cost 13% of its throughput at c=4: a decision that
    # must never cost takes the lower one.
    gains = {
        n: min(float(np.median([n * s / max(b, 1e-9) for s, b in p])), n * runs[1] / max(runs[n], 1e-9))
        for n, p in measured.items()
    }
    helping = [n for n, g in gains.items() if g >= margin]
    largest = max(measured)
    if not helping:
        why = (
            f"batching cannot help: a batch of {largest} runs {gains[largest]:.2f}x the speed per row of single runs "
            f"({runs[largest]:.0f} us against {runs[1]:.0f} us; {margin:.2f}x needed): runs unbatched"
        )
        return BatchFit(1, why, True, runs, gains)
    rows = max(helping)
    why = f"a batch of {rows} runs {gains[rows]:.2f}x the speed per row of single runs"
    why += f" ({runs[rows]:.0f} us against {runs[1]:.0f} us)"
    if rows < max_batch:
        what = "helps no more" if largest > rows else "was not measured (time budget)"
        why += f"; batches of at most {rows} rows: a larger one {what}"
    return BatchFit(rows, why, True, runs, gains)


def measure(
    run: Callable[[Inputs], object],
    inputs: Inputs,
    candidates: Sequence[int],
    single_us: float,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[int, list[tuple[float, float]]]:
    """Alternated (single, batched) runs at each candidate size that fits the budget, in us.
    ``inputs``: the warm-up's; its first row is the single request."""
    one = {n: a[:1] for n, a in inputs.items()}
    row_bytes = sum(a.nbytes for a in one.values())
    budget = min(CAP_US, max(BUDGET_US, BUDGET_RUNS * single_us))
    spent = 0.0
    single, per_row = single_us, single_us  # the projection: a single run, a batched row at most
    out: dict[int, list[tuple[float, float]]] = {}
    for n in candidates:
        # A batched row costs at most what one did in the last size measured (the warm-up's single
        # run before any): the warming run and MIN_PAIRS pairs must fit what is left.
        if n * row_bytes > MAX_BATCH_BYTES or spent + n * per_row + MIN_PAIRS * (single + n * per_row) > budget:
            break
        joined = _joiner(run, one, n)
        spent += timed_us(joined, clock)  # its first run sizes the larger buffers: not counted
        own = out[n] = []
        share = spent + (budget - spent) / 2  # what this size may use, leaving the rest for larger ones
        while len(own) < MAX_PAIRS and (len(own) < MIN_PAIRS or spent < share):
            # In turns first: the run after a pause wakes ONNX Runtime's pool and pays for it (the
            # mlp2k model's single run read 1.3 ms first in its pair against 0.7 ms second).
            first, second = (lambda: run(one), joined) if len(own) % 2 == 0 else (joined, lambda: run(one))
            a, b = timed_us(first, clock), timed_us(second, clock)
            pair = (a, b) if len(own) % 2 == 0 else (b, a)
            own.append(pair)
            spent += a + b
        single = run_cost_us([p[0] for p in own])
        per_row = max(run_cost_us([p[1] for p in own]) / n, single / n)
    return out


def _joiner(run: Callable[[Inputs], object], one: Inputs, n: int) -> Callable[[], object]:
    def joined() -> object:  # the scheduler's join of n requests, then the run
        return run({name: np.concatenate([a] * n) for name, a in one.items()})

    return joined


def fit_batching(
    run: Callable[[Inputs], object],
    inputs: Inputs,
    max_batch: int,
    preferred: Sequence[int],
    single_us: float | None,
    model: str = "",
    clock: Callable[[], float] = time.perf_counter,
) -> BatchFit:
    """Measure and decide (blocking: a worker thread's job). Without warm-up figures, or when a
    batched run fails (an engine whose profile stops short of ``max_batch``), the configured
    batching stands, and the reason says so."""
    if single_us is None or not inputs or any(a.ndim == 0 or a.shape[0] < 1 for a in inputs.values()):
        return BatchFit(max_batch, "not measured (no warm-up runs): batches as configured")
    try:
        pairs = measure(run, inputs, sizes(max_batch, preferred), single_us, clock)
    except Exception as e:  # an optimisation: its failure must not fail the model
        log.warning("batching not measured: a batched run failed: %s", e, extra={"model": model})
        why = f"not measured: a batched run failed ({e.__class__.__name__}): batches as configured"
        return BatchFit(max_batch, why)
    fit = decide(pairs, max_batch)
    log.info("batching: %s", fit.reason, extra={"model": model})
    return fit


def not_batched(max_batch: int, batchable: bool, inline_us: float | None) -> BatchFit | None:
    """The fit of a model that is not measured at all (None: measure it): one that does not batch
    by its configuration or its inputs, or one cheap enough to run on the event loop, where a
    request never queues behind a busy worker, so none ever forms a batch."""
    if max_batch <= 1:
        return BatchFit(1, "max_batch is 1")
    if not batchable:
        return BatchFit(1, "not every input's first dimension is dynamic: nothing to batch along")
    if inline_us is not None and math.isfinite(inline_us):
        return BatchFit(
            1,
            f"runs on the event loop ({inline_us:.0f} us a run, under server.inline_threshold_us): "
            "a batch would save less than the hand-off to a worker costs",
        )
    return None
