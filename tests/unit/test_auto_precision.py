"""precision = "auto": the choice among the candidates' figures (a pure function), the alternated
timing on a fake clock, the cache key that holds the choice, and the config rule."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import pytest

from edged.backends.base import Backend
from edged.backends.onnxruntime import OnnxRuntimeBackend
from edged.config import ConfigError, from_mapping
from edged.quantize.choice import MARGIN, Candidate, choose
from edged.quantize.figures import auto_text
from edged.quantize.job import BuildJob, job_key, key_fields, make_job
from edged.quantize.timing import MAX_ROUNDS, MIN_ROUNDS, plan_blocks, time_alternating


def fp32(ms: float) -> Candidate:
    return Candidate("fp32", "fp32", True, ms)


def int8(ms: float | None, passed: bool = True, label: str = "int8", note: str = "") -> Candidate:
    return Candidate("int8", label, passed, ms, note)


# --- the choice ----------------------------------------------------------------------------------


def test_the_more_precise_wins_when_it_is_faster() -> None:
    choice = choose([int8(85.0), fp32(61.2)])
    assert choice is not None and choice.precision == "fp32"
    assert choice.why == "fp32 61.2 ms: int8 is slower (85 ms)"


def test_a_less_precise_candidate_wins_by_the_margin() -> None:
    choice = choose([fp32(100.0), int8(90.0, label="int8 (mixed)")])
    assert choice is not None and (choice.precision, choice.label) == ("int8", "int8 (mixed)")
    assert "10.0% faster than fp32 (100 ms)" in choice.why


def test_a_less_precise_candidate_within_the_margin_loses() -> None:
    faster = 100.0 * (1 - MARGIN) + 0.5  # faster, but by less than the margin
    choice = choose([fp32(100.0), int8(faster)])
    assert choice is not None and choice.precision == "fp32"
    assert "under the 3% margin" in choice.why
    exactly = choose([fp32(100.0), int8(100.0 * (1 - MARGIN))])
    assert exactly is not None and exactly.precision == "int8"


def test_a_candidate_that_failed_its_gate_is_never_chosen_however_fast() -> None:
    failed = int8(None, passed=False, note="failed the accuracy gate (mask_iou 0.91 < 0.95)")
    choice = choose([failed, fp32(100.0)])
    assert choice is not None and choice.precision == "fp32"
    assert "int8 failed the accuracy gate (mask_iou 0.91 < 0.95)" in choice.why
    # Timed or not, a failed gate is not eligible.
    assert choose([int8(1.0, passed=False), fp32(100.0)]).precision == "fp32"  # type: ignore[union-attr]


def test_each_step_down_must_win_by_the_margin_over_the_one_chosen_so_far() -> None:
    fp16 = Candidate("fp16", "fp16", True, 80.0)
    # fp16 beats fp32 by 20%; int8 is only 2% faster than fp16: fp16 serves.
    choice = choose([int8(78.4), fp16, fp32(100.0)])
    assert choice is not None and choice.precision == "fp16"
    assert "20.0% faster than fp32" in choice.why and "int8 78.4 ms is 2.0% faster, under" in choice.why
    # fp16 within the margin of fp32, int8 beyond it: int8 serves, fp32 is what it beat.
    choice = choose([int8(90.0), Candidate("fp16", "fp16", True, 99.0), fp32(100.0)])
    assert choice is not None and choice.precision == "int8"


def test_nothing_eligible_is_no_choice() -> None:
    assert choose([int8(None, passed=False), Candidate("fp32", "fp32", True, None)]) is None
    assert choose([]) is None


def test_the_status_line_shows_every_candidate_and_the_choice() -> None:
    auto = {
        "candidates": [
            {"precision": "fp32", "label": "fp32", "passed": True, "median_ms": 61.23},
            {"precision": "int8", "label": "int8", "passed": False, "note": "failed the accuracy gate (x)"},
        ],
        "choice": {"precision": "fp32", "why": "fp32 61.2 ms: int8 failed the accuracy gate (x)"},
    }
    text = auto_text(auto)
    assert text.startswith("candidates fp32 61.2 ms [reference], int8 not timed [failed the accuracy gate (x)]")
    assert text.endswith("chose fp32 61.2 ms: int8 failed the accuracy gate (x)")
    assert auto_text(None) == "-"
    slow = choose([fp32(1105.15), int8(1291.13)])  # a loaded machine's figures
    assert slow is not None and slow.why == "fp32 1105 ms: int8 is slower (1291 ms)"


# --- the timing ----------------------------------------------------------------------------------


class FakeClock:
    """A clock each fake run advances by its own cost; the log records who ran when."""

    def __init__(self) -> None:
        self.now = 0.0
        self.log: list[str] = []

    def __call__(self) -> float:
        return self.now

    def run(self, name: str, seconds: Callable[[int], float]) -> Callable[[], None]:
        count = [0]

        def go() -> None:
            self.now += seconds(count[0])
            count[0] += 1
            self.log.append(name)

        return go

    def pause(self, seconds: float) -> None:
        self.now += seconds
        self.log.append("pause")


def test_alternating_blocks_turn_the_order_and_pause_before_each_block() -> None:
    clock = FakeClock()
    # b's first timed runs are slow (a neighbour's burst): the median shrugs it off.
    runs = {"a": clock.run("a", lambda i: 0.010), "b": clock.run("b", lambda i: 0.5 if i in (3, 4) else 0.020)}
    timings = time_alternating(runs, clock=clock, pause=clock.pause, budget_s=8.0)
    assert timings["a"].median_ms == pytest.approx(10.0) and timings["b"].median_ms == pytest.approx(20.0)
    assert MIN_ROUNDS <= timings["a"].rounds <= MAX_ROUNDS
    assert timings["a"].block == 20 and timings["b"].block == 10  # about 0.2 s of runs per block
    blocks = [name for prev, name in zip(clock.log, clock.log[1:]) if prev == "pause"]
    assert blocks[:4] == ["a", "b", "b", "a"]  # the first to run changes every round
    assert len(blocks) == 2 * timings["a"].rounds
    assert clock.log[:7] == ["a"] * 3 + ["b"] * 3 + ["pause"]  # the untimed warm-up runs come first


def test_the_rounds_stay_within_their_bounds() -> None:
    assert plan_blocks({"a": 1e-5}, budget_s=8.0) == ({"a": 200}, MAX_ROUNDS)  # a tiny model: capped block
    blocks, rounds = plan_blocks({"a": 5.0, "b": 7.0}, budget_s=8.0)  # seconds per run
    assert blocks == {"a": 1, "b": 1} and rounds == MIN_ROUNDS


# --- the cache key -------------------------------------------------------------------------------


class FakeOtherCpu(OnnxRuntimeBackend):
    """ONNX Runtime on another CPU: the same backend, another device fingerprint."""

    @classmethod
    def fingerprint(cls) -> dict[str, str]:
        return {"arch": "aarch64", "cpu": "Cortex-A78AE", "isa": "0"}


def job(precision: str, warmup: dict[str, Any] | None = None) -> BuildJob:
    model = from_mapping(
        {
            "models": {
                "m": {
                    "path": "/models/m.onnx",
                    "precision": precision,
                    "calibration": {"data": "/data"},
                    "warmup": warmup or {},
                }
            }
        }
    ).models["m"]
    return make_job("m", model, OnnxRuntimeBackend, precision, "/cache", lambda p: "d" * 64, lambda m: "c" * 64)


def test_an_auto_choice_never_shares_a_key_with_an_explicit_entry() -> None:
    auto = job("auto")
    keys = {p: job_key(auto.at_precision(p), OnnxRuntimeBackend) for p in ("int8", "fp32")}
    assert job_key(auto, OnnxRuntimeBackend) not in keys.values()
    # Its candidates are the explicit entries themselves: an explicit build reuses what auto built.
    assert keys == {p: job_key(job(p), OnnxRuntimeBackend) for p in ("int8", "fp32")}
    fields = key_fields(auto, OnnxRuntimeBackend)
    assert fields["precision"] == "auto" and fields["auto"]["margin"] == MARGIN
    assert fields["calibration"]["digest"] == "c" * 64  # its int8 candidate calibrates


def test_another_device_or_other_warmup_shapes_choose_again() -> None:
    auto = job("auto")
    assert job_key(auto, FakeOtherCpu) != job_key(auto, OnnxRuntimeBackend)
    wider = job("auto", {"inputs": {"x": {"shape": [1, 3, 1280, 1280]}}})
    assert job_key(wider, OnnxRuntimeBackend) != job_key(auto, OnnxRuntimeBackend)
    # An explicit precision's key does not hang on the warm-up.
    assert job_key(wider.at_precision("int8"), OnnxRuntimeBackend) == job_key(job("int8"), OnnxRuntimeBackend)


# --- the config ----------------------------------------------------------------------------------


def test_auto_needs_calibration_data() -> None:
    with pytest.raises(ConfigError, match=r"models.det.precision: auto needs calibration data"):
        from_mapping({"models": {"det": {"path": "x", "precision": "auto"}}})


class FakeOnePrecision(Backend):
    """A backend with a single precision (as llama.cpp's, whose module needs llama_cpp, which the
    unit tests' Python 3.10 venv does not install): pure logic of the base class's rule."""

    name = "fake"
    precisions: ClassVar[tuple[str, ...]] = ("fp32",)


def test_backends_without_a_choice_run_fp32() -> None:
    assert OnnxRuntimeBackend.effective_precision("auto") == ("auto", "")
    precision, why = FakeOnePrecision.effective_precision("auto")
    assert precision == "fp32" and "auto" in why
