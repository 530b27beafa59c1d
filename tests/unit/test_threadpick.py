"""Intra-op threads chosen at warm-up (edged/serving/threadpick.py).

The search is pure logic: its instances are fakes (``FakeInstance``) whose runs take a scripted
time per thread count on a fake clock (``FakeClock``), so each case says what the model costs
with how many threads. The last tests build real ONNX Runtime sessions with fewer threads."""

from __future__ import annotations

import gc
import logging
import os
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import pytest

from edged.backends.base import Instance, LoadOptions
from edged.backends.onnxruntime import OnnxRuntimeBackend
from edged.serving import threadpick
from edged.serving.threadpick import SAMPLES, TIE, TRIAL_MAX_US, candidates, fit_threads, pick_threads
from tests.helpers import FakeClock, unavailable


class FakeInstance:
    """A runner with ``threads`` threads whose runs take ``cost(threads, run_index)`` us."""

    def __init__(self, clock: FakeClock, threads: int, cost: Callable[[int, int], float]) -> None:
        self.clock, self.threads, self.cost, self.runs = clock, threads, cost, 0

    def run(self) -> None:
        self.clock.now += self.cost(self.threads, self.runs) / 1e6
        self.runs += 1


def search(auto: int, cost: Callable[[int, int], float]) -> tuple[int, float, list[int]]:
    clock = FakeClock()
    built: list[int] = []

    def build(n: int) -> FakeInstance:
        built.append(n)
        return FakeInstance(clock, n, cost)

    pick = pick_threads(FakeInstance(clock, auto, cost), auto, build, FakeInstance.run, clock)
    assert pick.instance.threads == pick.threads
    return pick.threads, pick.cost_us, built


def test_candidates_are_one_then_halvings_of_the_rule() -> None:
    assert list(candidates(16)) == [1, 8, 4, 2]
    assert list(candidates(12)) == [1, 6, 3]
    assert list(candidates(2)) == [1]


def test_a_model_with_nothing_to_split_runs_with_one_thread() -> None:
    # The tiny MLP on the 2-core machine: 24 us with its two threads, 15 us with one.
    threads, cost, built = search(2, lambda n, i: 15.0 if n == 1 else 24.0)
    assert (threads, built) == (1, [1])
    assert cost == pytest.approx(15.0)
    # Even (the 16-core host, 6.5 us either way): one thread, and nothing more is built.
    assert search(16, lambda n, i: 6.5)[::2] == (1, [1])


def test_a_model_the_pool_speeds_up_keeps_the_rule() -> None:
    # mlp2k on the 16-core host: 772 us on one thread, 170 on 8, 129 on 16.
    table = {1: 772.0, 2: 426.0, 4: 254.0, 8: 170.0, 16: 129.0}
    threads, cost, built = search(16, lambda n, i: table[n])
    assert (threads, built) == (16, [1, 8])  # 8 is behind: fewer would be further behind
    assert cost == pytest.approx(129.0)


def test_the_fewest_threads_where_the_run_levels_off() -> None:
    table = {1: 400.0, 2: 210.0, 4: 101.0, 8: 100.0, 16: 100.0}
    threads, _, built = search(16, lambda n, i: table[n])
    assert (threads, built) == (4, [1, 8, 4, 2])


def test_slower_by_more_than_the_tie_keeps_more_threads() -> None:
    over = TIE * 100.0 * 1.02
    assert search(16, lambda n, i: 100.0 if n == 16 else over)[::2] == (16, [1, 8])
    assert search(16, lambda n, i: 100.0 if n == 16 else 100.0 * TIE * 0.99)[::2] == (1, [1])


@pytest.mark.parametrize("slow_at", [0, 5, SAMPLES - 1])
def test_a_few_runs_the_host_delayed_do_not_decide(slow_at: int) -> None:
    # Eight delayed runs of the candidate (a third of them), wherever they fall: still one thread.
    def cost(n: int, i: int) -> float:
        return 1000.0 if n == 1 and slow_at <= i < slow_at + 8 else 10.0

    assert search(16, cost)[0] == 1


def test_a_slow_model_stops_at_the_budget() -> None:
    clock = FakeClock()
    rule = FakeInstance(clock, 16, lambda n, i: 20_000.0)
    pick = pick_threads(rule, 16, lambda n: FakeInstance(clock, n, lambda n, i: 20_000.0), FakeInstance.run, clock)
    assert rule.runs < 5  # 30 ms of runs per comparison, not SAMPLES of 20 ms each
    assert pick.threads == 1


# --- fit_threads with real ONNX Runtime sessions -----------------------------------------------


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def _backend(model_dir: Path, threads: int = 0) -> OnnxRuntimeBackend:
    b = OnnxRuntimeBackend(model_dir / "tiny.onnx", LoadOptions(threads=threads))
    b.load()
    return b


def _inputs() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(0).random((1, 16), dtype=np.float32)}


def test_a_configured_count_is_never_measured(model_dir: Path) -> None:
    b = _backend(model_dir, threads=3)
    insts: list[Instance] = [b.instance()]
    first = insts[0]
    assert (b.auto_threads(), first.threads) == (0, 3)
    assert fit_threads(b, insts, _inputs(), 10.0) == 10.0
    assert insts == [first]


def _need_cores() -> None:
    if _cores() < 2:
        unavailable(f"one CPU in this process's affinity ({os.sched_getaffinity(0)}): nothing to choose")


def test_fewer_threads_run_the_same_model(model_dir: Path) -> None:
    _need_cores()
    b = _backend(model_dir)
    rule = b.instance()
    assert rule.threads == b.auto_threads() == _cores()
    one = b.instance(1)
    assert one.threads == 1
    x = _inputs()
    np.testing.assert_allclose(one.infer(x)["probs"], rule.infer(x)["probs"], rtol=1e-6)
    insts = [rule, b.instance()]
    cost = fit_threads(b, insts, x, 400.0)
    assert len(insts) == 2 and insts[0].threads == insts[1].threads
    assert 1 <= insts[0].threads <= _cores() and cost is not None and cost > 0
    np.testing.assert_allclose(insts[1].infer(x)["probs"], rule.infer(x)["probs"], rtol=1e-6)


class CountingInstance(Instance):
    """A real instance, its runs counted (the test's wrapper, as the registry's fault wrapper)."""

    def __init__(self, inner: Instance) -> None:
        super().__init__(inner.backend, inner.threads)
        self.inner, self.runs = inner, 0

    def _infer_impl(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.runs += 1
        return self.inner._infer_impl(inputs)


def test_the_chosen_count_replaces_every_instance_in_place_warmed(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _need_cores()
    monkeypatch.setattr(threadpick, "TIE", 1e9)  # any candidate ties: one thread wins, deterministically
    b = _backend(model_dir)
    insts = [b.instance(), b.instance()]
    sessions = [weakref.ref(i._session) for i in insts]  # type: ignore[attr-defined]
    # A warm-up cost no trial run can reach twice of (400 us): the host never looks busier.
    cost = fit_threads(b, insts, _inputs(), 400.0, wrap=CountingInstance)
    assert [i.threads for i in insts] == [1, 1] and cost is not None
    counted = [i for i in insts if isinstance(i, CountingInstance)]
    assert len(counted) == 2 and all(i.runs >= 3 for i in counted)  # each one warmed before serving
    gc.collect()
    assert [s() for s in sessions] == [None, None]  # the rule's sessions are gone, on this thread


def test_a_trial_on_a_host_busier_than_the_warm_up_keeps_the_rule(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _need_cores()
    monkeypatch.setattr(threadpick, "TIE", 1e9)
    monkeypatch.setattr(threadpick, "BUSY", 0.0)  # the rule's run, however fast, counts as slowed
    caplog.set_level(logging.INFO, logger="edged.serving.threadpick")
    b = _backend(model_dir)
    insts: list[Instance] = [b.instance()]
    first = insts[0]
    assert fit_threads(b, insts, _inputs(), 10.0, model="tiny") == 10.0
    assert insts == [first] and first.threads == _cores()
    assert "the host was busy during the trial" in caplog.text


def test_a_model_past_the_trial_bound_or_a_failed_trial_keeps_its_instances(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _need_cores()
    b = _backend(model_dir)
    insts: list[Instance] = [b.instance()]
    first = insts[0]
    assert fit_threads(b, insts, _inputs(), TRIAL_MAX_US) == TRIAL_MAX_US

    def broken(inst: Instance) -> Instance:
        raise MemoryError("no room for a second session")

    assert fit_threads(b, insts, _inputs(), 10.0, wrap=broken, model="tiny") == 10.0
    assert insts == [first]
    assert "the trial with fewer failed: no room for a second session" in caplog.text


def test_an_instance_the_warm_up_replaces_frees_its_session(model_dir: Path) -> None:
    # The backend handed its first session (made at load) to the first instance and kept it too:
    # replaced by a one-thread instance, the rule's session and its pool lived on with the backend.
    b = _backend(model_dir)
    rule = b.instance()
    session = weakref.ref(rule._session)  # type: ignore[attr-defined]
    del rule
    gc.collect()
    assert session() is None
    assert b.instance().infer(_inputs())["probs"].shape == (1, 4)  # the next instance builds its own
