"""The warm-up's measure of one run, which decides whether a model runs on the event loop
(edged.serving.warmup.warm_cost_us): stable against a noisy host, and never cheap for a model that is not.

Pure logic: the model is a fake (``FakeModel``) whose runs take scripted times on a fake clock
(``FakeClock``), so each case says exactly which runs were slow."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable

import pytest

from edged.serving.warmup import INLINE_SAMPLES, loop_cost_us, run_cost_us, warm_cost_us
from tests.helpers import FakeClock

THRESHOLD = 60.0  # server.inline_threshold_us's default


class FakeModel:
    """One instance: each run takes the next scripted time (us), the last one repeating."""

    def __init__(self, clock: FakeClock, times_us: Iterable[float]) -> None:
        self.clock = clock
        self.times = iter(times_us)
        self.last = 0.0
        self.runs = 0

    def __call__(self) -> None:
        self.last = next(self.times, self.last)
        self.clock.now += self.last / 1e6
        self.runs += 1


def cost(times_us: list[float], iterations: int = 3, threshold: float | None = THRESHOLD) -> tuple[float | None, int]:
    clock = FakeClock()
    model = FakeModel(clock, times_us)
    return warm_cost_us([model], iterations, threshold, clock), model.runs


def inline(times_us: list[float], iterations: int = 3) -> bool:
    c, _ = cost(times_us, iterations)
    return c is not None and c < THRESHOLD


def test_a_cheap_model_whose_warm_up_median_was_over_the_threshold_is_still_inline() -> None:
    # The median of these three warm-up runs (70 us) put tiny on a worker thread on some starts.
    assert inline([300.0, 70.0, 12.0, 12.0])
    assert inline([300.0, 95.0, 75.0, 12.0])  # all three warm-up runs slow: the extra runs are not
    assert inline([900.0, 230.0, 200.0, 12.0])  # within 4x the threshold: a candidate still


def test_the_cost_is_read_from_enough_runs_and_leaves_the_first_out() -> None:
    c, runs = cost([5000.0, 20.0])
    assert runs == INLINE_SAMPLES + 1  # the first (cold) run is not a sample
    assert c == pytest.approx(20.0)


@pytest.mark.parametrize("slow_at", range(INLINE_SAMPLES + 1))
def test_one_slow_run_anywhere_cannot_flip_a_cheap_model(slow_at: int) -> None:
    times = [15.0] * (INLINE_SAMPLES + 1)
    times[slow_at] = 20_000.0  # the host took the core away once, for a few scheduler slices
    assert inline(times)


def test_a_cheap_model_stays_inline_when_a_third_of_its_runs_are_slowed() -> None:
    slow = itertools.cycle([15.0, 15.0, 400.0])
    assert inline([next(slow) for _ in range(INLINE_SAMPLES + 1)])


@pytest.mark.parametrize("fast_at", range(1, INLINE_SAMPLES + 1))
def test_a_model_that_costs_more_than_the_threshold_never_runs_inline(fast_at: int) -> None:
    # 80 us a run, one run at 40 us (a fast outlier) at any position: still not on the loop.
    times = [400.0] + [80.0] * INLINE_SAMPLES
    times[fast_at] = 40.0
    assert not inline(times)


def test_a_slow_model_gets_no_extra_runs() -> None:
    c, runs = cost([5000.0, 1500.0, 1400.0])
    assert runs == 3
    assert c is not None and c >= 1400.0
    _, runs = cost([5000.0, 250.0, 250.0])  # over 4x the threshold: not worth timing further
    assert runs == 3


def test_a_model_just_over_the_threshold_is_timed_further_and_stays_on_its_worker() -> None:
    c, runs = cost([400.0, 70.0, 70.0, 66.0])
    assert runs == INLINE_SAMPLES + 1
    assert c is not None and c >= THRESHOLD


def test_extra_runs_stop_when_they_stop_being_cheap() -> None:
    # Fast warm-up, then runs of 10 ms: the extra runs stop after their budget, not at 16 runs.
    c, runs = cost([200.0, 40.0, 40.0, 10_000.0])
    assert runs < INLINE_SAMPLES
    assert c is not None and c >= THRESHOLD


def test_no_extra_runs_for_a_model_that_may_not_run_inline() -> None:
    c, runs = cost([300.0, 12.0, 12.0], threshold=None)
    assert runs == 3
    assert c == pytest.approx(12.0)


def test_every_instance_is_warmed_and_each_first_run_is_left_out() -> None:
    clock = FakeClock()
    models = [FakeModel(clock, [900.0, 30.0, 30.0]), FakeModel(clock, [800.0, 32.0, 32.0])]
    c = warm_cost_us(models, 3, None, clock)
    assert [m.runs for m in models] == [3, 3]
    assert c is not None and 29.99 <= c <= 32.01


def test_no_warm_up_runs_no_cost() -> None:
    c, runs = cost([10.0], iterations=0)
    assert (c, runs) == (None, 0)


def test_a_single_warm_up_run_is_a_sample() -> None:
    c, runs = cost([25.0], iterations=1, threshold=None)
    assert (c, runs) == (pytest.approx(25.0), 1)


def test_the_cost_is_the_lower_quartile() -> None:
    assert run_cost_us([10.0, 20.0, 30.0, 40.0, 50.0]) == pytest.approx(20.0)


def test_the_loop_check_runs_back_to_back_in_slices_the_loop_can_serve_between() -> None:
    """edged.serving.warmup.loop_cost_us: INLINE_SAMPLES runs, their lower quartile, back to back within
    slices of about a millisecond, with the loop's other work run between the slices."""
    clock = FakeClock()
    model = FakeModel(clock, [400.0] * 3 + [20.0] * 40)  # three slow runs, then cheap ones
    served = 0

    async def other_work() -> None:
        nonlocal served
        while True:
            served += 1
            await asyncio.sleep(0)

    async def measure() -> tuple[float, int]:
        task = asyncio.get_running_loop().create_task(other_work())
        await asyncio.sleep(0)
        before = served
        got = await loop_cost_us(model, clock)
        task.cancel()
        return got, served - before

    got, between = asyncio.run(measure())
    assert got == pytest.approx(20.0) and model.runs == INLINE_SAMPLES
    # 400 us runs: a slice holds three (1.2 ms), the rest (260 us) fit in the next: the loop
    # served between the two, and before the first.
    assert between >= 2
