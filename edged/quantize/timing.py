"""The candidates of ``precision = "auto"`` timed on the device, in the build child.

Each candidate's engine runs the model's warm-up inputs (the shapes it serves at) on one
instance with the threads it serves with. The runs are interleaved in alternating blocks, the
order turning every round, with a pause before each block: ONNX Runtime's intra-op pool spins
after a run, and run back to back the candidates steal each other's cores (design brief: a
0.92 ms model read 3.3 ms), and whatever else the machine does in a moment (a stand-in serving
requests, another tenant) falls on every candidate alike. Each candidate's figure is the median
of all its runs.

Bounded: WARM_RUNS untimed runs each, then blocks of about BLOCK_S (at most MAX_BLOCK runs), as
many rounds as fit BUDGET_S, at least MIN_ROUNDS and at most MAX_ROUNDS. A model whose single
run takes seconds therefore takes MIN_ROUNDS runs per candidate, and the build's own
``build.timeout_s`` bounds the rest.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

WARM_RUNS = 3
BLOCK_S = 0.2
MAX_BLOCK = 200
PAUSE_S = 0.1
MIN_ROUNDS = 4
MAX_ROUNDS = 10
BUDGET_S = 8.0

Clock = Callable[[], float]


@dataclass(frozen=True)
class Timing:
    median_ms: float
    runs: int
    rounds: int
    block: int

    def to_dict(self) -> dict[str, Any]:
        return {"median_ms": round(self.median_ms, 4), "runs": self.runs, "rounds": self.rounds, "block": self.block}


def _timed(run: Callable[[], object], clock: Clock) -> float:
    t0 = clock()
    run()
    return clock() - t0


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def plan_blocks(estimates: Mapping[str, float], budget_s: float = BUDGET_S) -> tuple[dict[str, int], int]:
    """Runs per block for each candidate (from its estimated seconds per run) and the rounds."""
    blocks = {name: max(1, min(MAX_BLOCK, round(BLOCK_S / max(est, 1e-7)))) for name, est in estimates.items()}
    per_round = sum(blocks[name] * est + PAUSE_S for name, est in estimates.items())
    rounds = max(MIN_ROUNDS, min(MAX_ROUNDS, int(budget_s // max(per_round, 1e-9))))
    return blocks, rounds


def time_alternating(
    runs: Mapping[str, Callable[[], object]],
    clock: Clock = time.perf_counter,
    pause: Callable[[float], None] = time.sleep,
    budget_s: float = BUDGET_S,
) -> dict[str, Timing]:
    """Each run's median in milliseconds, from alternating blocks (see the module's docstring)."""
    estimates = {name: min(_timed(run, clock) for _ in range(WARM_RUNS)) for name, run in runs.items()}
    blocks, rounds = plan_blocks(estimates, budget_s)
    samples: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(rounds):
        turn = r % len(names)
        for name in names[turn:] + names[:turn]:
            pause(PAUSE_S)  # the previous block's threads settle before this one is timed
            samples[name] += [_timed(runs[name], clock) for _ in range(blocks[name])]
    return {name: Timing(_median(times) * 1e3, len(times), rounds, blocks[name]) for name, times in samples.items()}
