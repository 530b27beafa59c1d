"""Preferred batch sizes (Triton's dynamic batcher): a batch of a preferred size runs at once, one
that would pass the largest runs at the largest it holds, the rest waits for company."""

from __future__ import annotations

import asyncio

import numpy as np

from edged.serving.batching import preferred_cut
from edged.serving.scheduler import ModelQueue
from tests.unit.test_scheduler import FakeInstance


def test_the_longest_preferred_run_from_the_first_is_cut() -> None:
    assert preferred_cut([1, 1, 1, 1, 1], (2, 4), 4) == 4
    assert preferred_cut([1, 1, 1], (2, 4), 4) == 2
    assert preferred_cut([3], (2, 4), 4) == 0  # nothing preferred yet: wait for company
    assert preferred_cut([3, 3], (4,), 4) == 1  # the second would pass the largest
    assert preferred_cut([5], (4,), 4) == 0  # one request larger than every preferred size runs alone


def batches(preferred: tuple[int, ...], rows: list[int]) -> list[int]:
    """The batch sizes a held worker runs once ``rows``-row requests are queued behind a first."""
    inst = FakeInstance()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        q = ModelQueue("m", [inst], loop, 64, 8, max_queue_delay_us=100_000, batchable=True, preferred=preferred)
        inst.gate.clear()  # the worker takes the first request and is held in its run
        q.start()
        first = asyncio.ensure_future(q.submit({"x": np.ones((1, 2), np.float32)}, 30))
        while q.backlog < 1 or not any(w.busy_since for w in q.workers):
            await asyncio.sleep(0)
        rest = [asyncio.ensure_future(q.submit({"x": np.ones((n, 2), np.float32)}, 30)) for n in rows]
        while q.backlog < 1 + len(rows):
            await asyncio.sleep(0)
        inst.gate.set()
        await asyncio.gather(first, *rest)
        q.close()

    asyncio.run(main())
    return inst.batches


def test_a_preferred_batch_runs_as_soon_as_it_forms() -> None:
    # Without preferred sizes the five queued rows run as one batch of 5.
    assert batches((), [1, 1, 1, 1, 1]) == [1, 5]
    assert batches((2, 4), [1, 1, 1, 1, 1]) == [1, 4, 1]


def test_a_batch_stops_before_passing_the_largest_preferred_size() -> None:
    assert batches((), [3, 3]) == [1, 6]
    assert batches((4,), [3, 3]) == [1, 3, 3]
