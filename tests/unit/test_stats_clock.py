"""edged/serving/stats.py's wall-clock reading of the last request (Triton's last_inference): the same
record reads the same every time. Rebuilt from two clocks at each read, two reads could differ
by a millisecond of rounding (which tests/integration/test_triton_extensions.py would see).

Pure logic: the clocks are a fake (``FakeClocks``) whose wall clock gains 300 ns on the
performance counter at each pair of reads, as two real clocks read a few microseconds apart do."""

from __future__ import annotations

import pytest

from edged.serving import stats
from edged.serving.stats import ModelStatistics


class FakeClocks:
    def __init__(self) -> None:
        self.perf = 10**12
        self.wall = 1_700_000_000_000_000_000

    def perf_counter_ns(self) -> int:
        self.perf += 100
        return self.perf

    def time_ns(self) -> int:
        self.wall += 400
        return self.wall


@pytest.fixture
def clocks(monkeypatch: pytest.MonkeyPatch) -> FakeClocks:
    fake = FakeClocks()
    monkeypatch.setattr(stats, "time", fake)
    monkeypatch.setattr(stats, "_offset", [], raising=False)
    return fake


def test_last_inference_reads_the_same_every_time(clocks: FakeClocks) -> None:
    rec = ModelStatistics()
    now = clocks.perf_counter_ns()
    rec.succeeded(now - 1000, now - 500, now)
    reads = {rec.to_dict("m")["last_inference"] for _ in range(20_000)}
    assert len(reads) == 1, sorted(reads)
    (last,) = reads
    assert last == 1_700_000_000_000  # the fake wall clock, in ms, when the record was written


def test_the_offset_is_taken_again_after_a_minute(clocks: FakeClocks) -> None:
    rec = ModelStatistics()
    rec.succeeded(clocks.perf, clocks.perf, clocks.perf)
    first = rec.to_dict("m")["last_inference"]
    clocks.wall += 5_000_000  # the wall clock stepped 5 ms (NTP)
    assert rec.to_dict("m")["last_inference"] == first
    clocks.perf += 61 * 1_000_000_000
    clocks.wall += 61 * 1_000_000_000
    assert rec.to_dict("m")["last_inference"] == first + 5


def test_no_request_yet_is_zero() -> None:
    assert ModelStatistics().to_dict("m")["last_inference"] == 0
