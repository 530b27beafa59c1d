"""Whether batching can help a model: the decision from measured costs, and the measurement
itself on a fake clock (pure logic: the run only advances the clock by what it is said to cost)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import pytest

from edged.serving.batchfit import BUDGET_RUNS, BUDGET_US, MARGIN, decide, fit_batching, measure, not_batched, sizes

X = {"x": np.ones((1, 3, 8, 8), np.float32)}


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fake_model(clock: FakeClock, cost_us: Callable[[int], float]) -> tuple[Callable[..., object], list[int]]:
    """A run that costs ``cost_us(rows)`` on ``clock``, and the batch sizes it was given."""
    seen: list[int] = []

    def run(inputs: Mapping[str, np.ndarray]) -> object:
        rows = len(inputs["x"])
        seen.append(rows)
        clock.now += cost_us(rows) / 1e6
        return {}

    return run, seen


def test_the_sizes_measured_are_powers_of_two_the_preferred_ones_and_the_largest() -> None:
    assert sizes(8) == [2, 4, 8]
    assert sizes(12, (3, 12, 20)) == [2, 3, 4, 8, 12]
    assert sizes(1) == []


def steady(single: float, batched: dict[int, float], pairs: int = 5) -> dict[int, list[tuple[float, float]]]:
    """Pairs of a quiet host: every run costs the same each time."""
    return {n: [(single, us)] * pairs for n, us in batched.items()}


def test_a_conv_whose_batch_costs_as_much_as_its_single_runs_runs_unbatched() -> None:
    fit = decide(steady(2800.0, {2: 5600.0, 4: 11500.0, 8: 23000.0}), 8)
    assert (fit.rows, fit.measured) == (1, True)
    assert fit.reason.startswith("batching cannot help") and "a batch of 8" in fit.reason
    shown = fit.to_dict()
    assert shown["on"] is False and shown["runs_us"] == {"1": 2800.0, "2": 5600.0, "4": 11500.0, "8": 23000.0}
    assert shown["gains"]["8"] == pytest.approx(8 * 2800 / 23000, abs=1e-3)


def test_a_saving_within_the_margin_is_not_worth_a_batch() -> None:
    single = 1000.0
    assert decide(steady(single, {8: 8 * single / (MARGIN * 0.99)}), 8).rows == 1
    assert decide(steady(single, {8: 8 * single / (MARGIN * 1.01)}), 8).rows == 8


def test_a_batch_holds_at_most_the_largest_size_that_helps() -> None:
    fit = decide(steady(1000.0, {2: 1200.0, 4: 2000.0, 8: 9000.0, 16: 20000.0}), 16)
    assert fit.rows == 4 and fit.to_dict()["on"]
    assert "helps no more" in fit.reason


def test_an_mlp_whose_batch_shares_its_weights_batches_up_to_max_batch() -> None:
    fit = decide(steady(400.0, {2: 450.0, 4: 520.0, 8: 700.0, 16: 1100.0}), 16)
    assert (fit.rows, fit.measured) == (16, True) and "x the speed per row" in fit.reason


def test_a_busy_moment_that_slows_both_runs_of_a_pair_does_not_decide() -> None:
    # A conv net whose batch of 2 costs 2 single runs; in two pairs of five the host was busy
    # (both runs 4x slower), and in one of those the batch came out faster than the single run.
    pairs = {2: [(2800.0, 5600.0)] * 3 + [(11200.0, 22400.0), (16000.0, 12000.0)]}
    fit = decide(pairs, 8)
    assert fit.rows == 1 and fit.gains[2] == pytest.approx(1.0)


def test_pairs_that_favour_a_batch_do_not_decide_against_the_runs_own_costs() -> None:
    # The 16-core host's conv640: three pairs caught single runs slow, so the pairs' median says a
    # batch of 2 helps (1.21x) while the single runs' own cost says it costs (2 * 1447 / 3312).
    pairs = {2: [(2000.0, 3312.0)] * 3 + [(1447.0, 3400.0)] * 2}
    fit = decide(pairs, 8)
    assert fit.rows == 1 and fit.reason.startswith("batching cannot help")
    assert fit.gains[2] == pytest.approx(2 * 1447 / 3312, abs=1e-3)


def test_the_measurement_alternates_single_and_batched_runs() -> None:
    clock = FakeClock()
    run, seen = fake_model(clock, lambda n: 100.0 + 10.0 * n)  # a fixed cost per run: batching pays
    pairs = measure(run, X, [2, 4, 8], 110.0, clock)
    assert sorted(pairs) == [2, 4, 8] and all(len(p) >= 5 for p in pairs.values())
    assert pairs[8][0] == pytest.approx((110.0, 180.0))
    assert seen[:5] == [2, 1, 2, 2, 1]  # a warming run of the batch, then pairs, each side first in turn
    fit = decide(pairs, 8)
    assert fit.rows == 8 and fit.runs_us == pytest.approx({1: 110.0, 2: 120.0, 4: 140.0, 8: 180.0})


def test_a_slow_model_measures_only_the_sizes_its_budget_holds() -> None:
    clock = FakeClock()
    single = 40_000.0  # 40 ms a row: the budget (20 single runs' worth) holds the batch of 2 only
    run, _ = fake_model(clock, lambda n: single * n)
    pairs = measure(run, X, [2, 4, 8], single, clock)
    assert sorted(pairs) == [2]
    assert clock.now * 1e6 <= BUDGET_RUNS * single
    assert decide(pairs, 8).rows == 1  # 2 rows cost 2 single runs: no help


def test_the_measurement_stops_at_the_time_budget() -> None:
    clock = FakeClock()
    run, _ = fake_model(clock, lambda n: 1000.0 * n)
    measure(run, X, [2, 4, 8, 16, 32, 64], 1000.0, clock)
    assert clock.now * 1e6 <= BUDGET_US


def test_a_model_that_fits_no_batch_keeps_its_configured_batching() -> None:
    clock = FakeClock()
    run, _ = fake_model(clock, lambda n: 5e6 * n)  # 5 s a row
    fit = fit_batching(run, X, 8, (), 5e6, clock=clock)
    assert (fit.rows, fit.measured) == (8, False) and fit.reason.startswith("not measured")


def test_a_batched_run_that_fails_leaves_the_configured_batching() -> None:
    def run(inputs: Mapping[str, np.ndarray]) -> object:
        if len(inputs["x"]) > 1:
            raise RuntimeError("profile max is 1")
        return {}

    fit = fit_batching(run, X, 8, (), 100.0)
    assert (fit.rows, fit.measured) == (8, False) and "RuntimeError" in fit.reason


def test_without_warm_up_runs_nothing_is_measured() -> None:
    fit = fit_batching(lambda inputs: {}, {}, 8, (), None)
    assert (fit.rows, fit.measured) == (8, False)


def test_models_that_cannot_batch_are_not_measured() -> None:
    assert not_batched(1, True, None) is not None and not_batched(1, True, None).rows == 1  # type: ignore[union-attr]
    fixed = not_batched(8, False, None)
    assert fixed is not None and fixed.rows == 1 and "first dimension" in fixed.reason
    inline = not_batched(8, True, 12.0)
    assert inline is not None and inline.rows == 1 and "event loop" in inline.reason
    assert not_batched(8, True, None) is None  # measured
