"""Intra-op threads per model, chosen from a measurement at warm-up rather than a fixed rule.

A backend with a CPU thread pool (ONNX Runtime) gives an instance every core it may use by default
(cores / instances). That suits a model with work to split: a 1 ms conv net runs 2.9x faster on 16
threads than on one. A model of a few microseconds has nothing to split, yet its pool is woken and
parked around every run (``session.force_spinning_stop``): on the 2-core machine the tiny MLP's
run took 24 us with its two threads against 15 us with one, in a tight loop; on the 16-core host
the two were even in a tight loop (6.5 us), and the idle pool's threads are still the daemon's.

So a model whose warm run is cheap (under TRIAL_MAX_US) is measured with fewer threads: one
first, then halving down from the rule's count, each candidate's runs alternated with the rule's
instance so a busy moment of the host falls on both. The fewest threads that run within TIE of
the rule's count win; a model as fast with one thread runs with one. A model whose runs take
longer is left with the rule's count: there the pool pays, and trial sessions would lengthen the
start.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from edged.backends.base import Backend, Instance
from edged.serving.warmup import run_cost_us, timed_us

log = logging.getLogger(__name__)

# Models whose warm run costs less than this are tried with fewer threads; a run of a millisecond
# or more is where a pool's threads pay for themselves (and where extra sessions cost the start
# the most).
TRIAL_MAX_US = 500.0
# Fewer threads win when their run costs at most this much more than the rule's count: within
# what alternated low quartiles still differ by on a quiet host, fewer threads leave cores to the
# rest of the daemon and the machine.
TIE = 1.03
# Timed runs per side in one comparison, and the most one comparison may take (its runs on both
# sides together), so a model that was only cheap at warm-up cannot hold the start up.
SAMPLES = 24
BUDGET_US = 30_000.0
_WARM_RUNS = 3  # a candidate's first runs start its pool and fill its caches: not timed
# The rule's instance running more than this many times its warm-up cost during the trial: a host
# that got busy meanwhile (a lazy load or a reload beside traffic); the trial's verdict is not kept.
BUSY = 2.0

T = TypeVar("T")


@dataclass(frozen=True)
class Pick(Generic[T]):
    """What the measurement chose: the instance to serve with first (the rule's or a candidate's),
    its threads and one run's cost in microseconds; ``rule_us``: the rule's cost in the first
    comparison (against the warm-up's, it tells a host that got busy during the trial)."""

    instance: T
    threads: int
    cost_us: float
    rule_us: float = math.inf


def candidates(auto: int) -> Iterator[int]:
    """One thread, then the rule's count halved, halved again, down to two."""
    yield 1
    n = auto // 2
    while n > 1:
        yield n
        n //= 2


def compare(
    rule: Callable[[], object],
    candidate: Callable[[], object],
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[float, float]:
    """One run's cost of each (us, the lower quartile of alternated runs); the candidate comes
    warmed (``fit_threads``'s build runs it first, as the warm-up ran the rule's)."""
    a: list[float] = []
    b: list[float] = []
    spent = 0.0
    while len(b) < SAMPLES and spent < BUDGET_US:
        for run, out in ((rule, a), (candidate, b)):
            out.append(timed_us(run, clock))
            spent += out[-1]
    return run_cost_us(a), run_cost_us(b)


def pick_threads(
    rule: T,
    auto: int,
    build: Callable[[int], T],
    run: Callable[[T], object],
    clock: Callable[[], float] = time.perf_counter,
) -> Pick[T]:
    """Measure ``rule`` (an instance with the rule's ``auto`` threads) against instances built
    with fewer (``build``), each by ``run``; return the fewest threads within TIE of the rule.
    Once a candidate is slower than that, fewer threads would be slower still: the search stops
    (run time falls as threads grow, until it levels off)."""
    best = Pick(rule, auto, math.inf)
    for n in candidates(auto):
        inst = build(n)
        base_us, cand_us = compare(functools.partial(run, rule), functools.partial(run, inst), clock)
        if best.cost_us == math.inf:
            best = Pick(rule, auto, base_us, base_us)
        if cand_us > TIE * base_us:
            del inst  # freed before the next candidate is built: at most three sessions at once
            if n == 1:
                continue  # one thread is behind: the search goes on from the rule's count down
            break
        best = Pick(inst, n, cand_us, best.rule_us)
        if n == 1:
            break  # as fast as the pool with one thread: nothing fewer to try
    return best


def fit_threads(
    backend: Backend,
    instances: list[Instance],
    inputs: Mapping[str, np.ndarray],
    infer_us: float | None,
    wrap: Callable[[Instance], Instance] | None = None,
    model: str = "",
) -> float | None:
    """Serve with fewer intra-op threads where ``pick_threads`` finds them as fast: ``instances``
    (warmed, the rule's count) is replaced in place by as many new, warmed instances with that
    count, so the old sessions are freed here, on the caller's thread, not wherever the list's
    last holder drops it (the event loop). Returns one run's cost (``infer_us`` when nothing
    changed). ``wrap``: the registry's instance wrapper, tests' fault injection. A trial that
    fails (a session that cannot be built), or one that ran on a host busier than the warm-up
    saw, leaves the rule's instances: the model serves as it would have without it."""
    auto = backend.auto_threads()
    if not auto or not instances or infer_us is None or infer_us >= TRIAL_MAX_US:
        return infer_us

    def build(n: int) -> Instance:
        inst = backend.instance(n)
        inst = wrap(inst) if wrap is not None else inst
        for _ in range(_WARM_RUNS):  # as the warm-up warmed the rule's instances
            inst.infer(inputs)
        return inst

    try:
        # Runs as the warm-up's are (inputs checked), so the cost compares with infer_us.
        pick = pick_threads(instances[0], auto, build, lambda inst: inst.infer(inputs))
        if pick.threads == auto:
            return infer_us
        if pick.rule_us > BUSY * infer_us:
            # The rule's instance ran slower than at warm-up: the host got busy, which slows a
            # pool more than one thread. A choice made now would last for the runtime's life.
            log.info(
                "keeping %d intra-op threads: the host was busy during the trial (%.1f us a run against %.1f)",
                auto,
                pick.rule_us,
                infer_us,
                extra={"model": model},
            )
            return infer_us
        chosen = [pick.instance, *(build(pick.threads) for _ in instances[1:])]
    except Exception as e:  # the trial is an optimisation: its failure must not fail the model
        log.warning("keeping %d intra-op threads: the trial with fewer failed: %s", auto, e, extra={"model": model})
        return infer_us
    instances[:] = chosen
    log.info(
        "intra-op threads: %d (measured at warm-up against the rule's %d: %.1f us a run against %.1f)",
        pick.threads,
        auto,
        pick.cost_us,
        pick.rule_us,
        extra={"model": model},
    )
    return pick.cost_us
