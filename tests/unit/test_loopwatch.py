"""The loop-stall watchdog on a real asyncio event loop: a blocking call is seen, counted and
logged once; the gauge reports the worst lateness of the last window."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from edged.lifecycle.loopwatch import LoopWatch
from tests.helpers import FREEZE_S

# A stall is a lateness of FREEZE_S or more: a timer's ordinary lateness on a busy machine never
# reaches it, so the one blocking call below is the only stall there can be.
STALL_MS = int(FREEZE_S * 1000)
BLOCK_S = 1.5 * FREEZE_S


def run_with_watch(body_blocks_s: float) -> tuple[LoopWatch, list[tuple[float, bool]]]:
    samples: list[tuple[float, bool]] = []
    watch = LoopWatch(probe_ms=10, stall_ms=STALL_MS, on_sample=lambda late, stalled: samples.append((late, stalled)))

    async def main() -> None:
        watch.start(asyncio.get_running_loop())
        await asyncio.sleep(0.05)
        if body_blocks_s:
            time.sleep(body_blocks_s)  # the fault under test: a blocking call on the loop
        await asyncio.sleep(0.05)
        watch.stop()

    asyncio.run(main())
    return watch, samples


def test_a_blocking_call_is_one_stall(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "edged.lifecycle.loopwatch")
    watch, samples = run_with_watch(BLOCK_S)
    assert watch.stalls == 1
    assert watch.max_recent() >= BLOCK_S - 0.05  # the block, less at most one probe interval
    assert sum(stalled for _, stalled in samples) == 1
    assert len([r for r in caplog.records if "stalled" in r.getMessage()]) == 1


def test_the_gauge_keeps_the_worst_of_the_last_window() -> None:
    watch = LoopWatch(probe_ms=10, stall_ms=STALL_MS, window_s=1.0)
    watch._window_end = 10.0
    watch.sample(0.2, 5.0)
    watch.sample(0.01, 10.5)  # a new window: the last one's worst is still reported
    assert watch.max_recent() == pytest.approx(0.2)
    watch.sample(0.01, 12.0)  # and forgotten one window later
    assert watch.max_recent() == pytest.approx(0.01)
