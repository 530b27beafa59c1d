"""Warm-up: what one run of a model costs (which decides whether it runs on the event loop),
measured on its warm-up inputs (made by edged/backends/warm_inputs.py, re-exported here).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from edged.backends.base import TensorSpec
from edged.backends.warm_inputs import concrete_shape
from edged.backends.warm_inputs import random_tensor as random_tensor
from edged.backends.warm_inputs import warm_inputs as warm_inputs
from edged.config import ModelConfig

log = logging.getLogger(__name__)

# Work a request may do on the event loop: the inline path is for requests whose run costs about
# as much as the hand-off to a worker, never for one that holds every other client up.
INLINE_BUDGET_US = 1000.0


def inline_max_elements(specs: tuple[TensorSpec, ...], model: ModelConfig, infer_us: float) -> int:
    """The most input elements a request to an inline model may have and still run on the loop:
    the warm-up's element count, scaled (linearly, which overestimates the cost of a small
    model's larger request) to what fits in INLINE_BUDGET_US given the measured run time."""
    warm = sum(math.prod(concrete_shape(s, model)) for s in specs)
    return max(warm, int(warm * INLINE_BUDGET_US / max(infer_us, 1.0)))


# --- one run's cost: what decides whether a model runs on the event loop ----------------------

# Samples the cost of an inline candidate is read from: a model whose warm-up runs came near the
# threshold (within _CANDIDATE times it: three warm-up runs on a busy host can all be slow) gets
# more timed runs after its warm-up, up to this many samples in all.
INLINE_SAMPLES = 16
_CANDIDATE = 4.0
# Those extra runs stop once they have taken this long in all (normally they take well under a
# millisecond), so a model that only looked cheap cannot hold the start up; a single run the host
# delayed by a scheduler slice or two does not reach it.
_EXTRA_RUNS_BUDGET_US = 100_000.0


def run_cost_us(samples_us: Sequence[float]) -> float:
    """One run's cost from timed runs: their lower quartile. What a shared host adds to a run
    (preemption, caches another process evicted, another model warming beside it) only ever adds
    time, so a low percentile reads the model's own cost, where the median of three warm-up
    runs flipped across server.inline_threshold_us between starts of the same daemon. A
    quartile still needs a quarter of the runs to be that fast: a model that really costs more
    is not made to look cheap by one fast run."""
    return float(np.percentile(samples_us, 25))


def timed_us(run: Callable[[], object], clock: Callable[[], float]) -> float:
    """One run's wall time in microseconds on ``clock``."""
    t0 = clock()
    run()
    return (clock() - t0) * 1e6


def warm_cost_us(
    runs: Sequence[Callable[[], object]],
    iterations: int,
    inline_threshold_us: float | None,
    clock: Callable[[], float] = time.perf_counter,
) -> float | None:
    """Warm each instance (``runs``: one callable per instance, running the warm-up inputs)
    ``iterations`` times and return one run's cost in microseconds; None without warm-up runs.
    Each instance's first run pays for what warm-up is for (allocations, kernel caches, thread
    pools): it is left out of the cost. ``inline_threshold_us``: set when the model may run on
    the loop (one instance, not a generator); if its runs came near it, instance 0 runs again
    until there are INLINE_SAMPLES samples, so that the decision rests on enough runs."""
    if iterations <= 0 or not runs:
        return None
    samples: list[float] = []
    fastest = math.inf
    for run in runs:
        times = [timed_us(run, clock) for _ in range(iterations)]
        fastest = min(fastest, *times)
        samples += times[1:] or times
    if inline_threshold_us is None or fastest >= _CANDIDATE * inline_threshold_us:
        return run_cost_us(samples)
    extra, added = 0.0, 0
    while len(samples) < INLINE_SAMPLES:
        if extra >= _EXTRA_RUNS_BUDGET_US:
            # Out of budget before enough samples: these runs averaged several milliseconds (the
            # budget over fewer than INLINE_SAMPLES runs): not cheap, whatever the quartile says.
            return max(run_cost_us(samples), extra / added)
        took = timed_us(runs[0], clock)
        samples.append(took)
        extra += took
        added += 1
    return run_cost_us(samples)


# A model whose runs on a worker thread measured between the inline threshold and this may be
# cheaper than that: a thread's run waits for the GIL after it, which a busy loop holds (the tiny
# MLP measured 281 us against 23 us when its built engine was warmed while its stand-in served
# four clients, and stayed off the loop for the daemon's life). It is timed again on the loop.
LOOP_CHECK_MAX_US = 500.0
_LOOP_SLICE_S = 0.001


async def loop_cost_us(run: Callable[[], object], clock: Callable[[], float] = time.perf_counter) -> float:
    """One run's cost measured on the event loop, which holds the GIL: INLINE_SAMPLES runs, their
    lower quartile, back to back as a thread's warm-up runs them (runs with requests served
    between them measured 40-65 us for the tiny MLP's 23 us, their caches cold), in slices of
    about a millisecond between which the loop serves what is ready. Only for a model whose cost
    on a thread was under LOOP_CHECK_MAX_US (the caller checks it): its runs on the loop cost no
    more. For a model that would run there: the cost it would have inline."""
    samples: list[float] = []
    while len(samples) < INLINE_SAMPLES:
        await asyncio.sleep(0)
        began = clock()
        while len(samples) < INLINE_SAMPLES and clock() - began < _LOOP_SLICE_S:
            samples.append(timed_us(run, clock))
    return run_cost_us(samples)
