"""When the scheduler forms a batch (pure logic, on a fake instance a test can hold): at once when
an instance is idle, from what queued while it was busy, and a wait for company only for a
preferred size under load, never past the queue delay or a deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from edged.errors import DeadlineExceededError
from edged.serving.scheduler import ModelQueue
from tests.unit.test_scheduler import FakeInstance

LONG_DELAY_US = 100_000_000  # 100 s: a batcher that waited it out would fail every test here


def x(rows: int = 1) -> dict[str, np.ndarray]:
    return {"x": np.ones((rows, 2), np.float32)}


def queue(inst: FakeInstance, preferred: Sequence[int] = (), batch_rows: int | None = None) -> ModelQueue:
    loop = asyncio.get_running_loop()
    return ModelQueue(
        "m", [inst], loop, 64, 8, LONG_DELAY_US, batchable=True, preferred=preferred, batch_rows=batch_rows
    )


async def held(q: ModelQueue, inst: FakeInstance) -> asyncio.Future[dict[str, np.ndarray]]:
    """A first request the worker has taken and is held in, so that later ones queue."""
    inst.gate.clear()
    first = asyncio.ensure_future(q.submit(x(), 30))
    while not any(w.busy_since for w in q.workers):
        await asyncio.sleep(0)
    return first


async def queued(q: ModelQueue, n: int) -> None:
    while q.backlog < n:
        await asyncio.sleep(0)


def test_a_lone_request_runs_at_once_whatever_the_queue_delay() -> None:
    inst = FakeInstance()

    async def main() -> None:
        q = queue(inst, preferred=(4, 8))
        q.start()
        for _ in range(3):  # a deadline far below the delay: a wait would end each in a 504
            out = await q.submit(x(), 5)
            assert out["y"].shape == (1, 2)
        assert q.batch_stats() == {"batches": 3, "rows": 3, "batch_waits": 0}
        q.close()

    asyncio.run(main())
    assert inst.batches == [1, 1, 1]


def test_what_queued_while_the_instance_was_busy_runs_as_one_batch_without_waiting() -> None:
    inst = FakeInstance()

    async def main() -> None:
        q = queue(inst)
        q.start()
        first = await held(q, inst)
        rest = [asyncio.ensure_future(q.submit(x(), 5)) for _ in range(3)]
        await queued(q, 4)
        inst.gate.set()
        await asyncio.gather(first, *rest)
        assert q.batch_stats()["batch_waits"] == 0
        q.close()

    asyncio.run(main())
    assert inst.batches == [1, 3]  # three is short of max_batch: it runs, it does not wait for more


async def two_behind_one(q: ModelQueue, inst: FakeInstance, timeout: float) -> Sequence[asyncio.Future[Any]]:
    """Two requests queued behind a held one, the held one run: the worker has taken the two."""
    q.start()
    first = await held(q, inst)
    two = [asyncio.ensure_future(q.submit(x(), timeout)) for _ in range(2)]
    await queued(q, 3)
    inst.gate.set()
    await first
    return two


def test_a_batch_of_several_waits_for_a_preferred_size_and_runs_once_it_forms() -> None:
    inst = FakeInstance()

    async def main() -> None:
        q = queue(inst, preferred=(4,))
        two = await two_behind_one(q, inst, 30)
        while not q.batch_stats()["batch_waits"]:  # the two wait for company: none has run
            await asyncio.sleep(0)
        assert inst.batches == [1]
        more = [asyncio.ensure_future(q.submit(x(), 30)) for _ in range(2)]
        await asyncio.gather(*two, *more)
        q.close()

    asyncio.run(main())
    assert inst.batches == [1, 4]


def test_the_wait_for_a_preferred_size_ends_at_the_oldest_requests_deadline() -> None:
    inst = FakeInstance()

    async def main() -> None:
        q = queue(inst, preferred=(4,))
        for t in await two_behind_one(q, inst, 0.2):
            with pytest.raises(DeadlineExceededError):
                await t
        out = await q.submit(x(), 5)  # the worker serves again
        assert out["y"].shape == (1, 2)
        q.close()

    asyncio.run(main())
    assert inst.batches == [1, 1]  # the two expired while they waited: never run


def test_a_batch_holds_at_most_the_rows_measured_to_help() -> None:
    inst = FakeInstance()

    async def main() -> None:
        q = queue(inst, batch_rows=2)
        assert (q.max_batch, q.batch_rows) == (8, 2)
        q.start()
        first = await held(q, inst)
        rest = [asyncio.ensure_future(q.submit(x(), 5)) for _ in range(5)]
        rest.append(asyncio.ensure_future(q.submit(x(4), 5)))  # a request may still carry max_batch rows
        await queued(q, 7)
        inst.gate.set()
        await asyncio.gather(first, *rest)
        q.close()

    asyncio.run(main())
    assert inst.batches == [1, 2, 2, 1, 4]


def test_a_model_measured_not_to_batch_may_run_on_the_loop() -> None:
    inst = FakeInstance()

    async def main() -> None:
        unbatched = queue(inst, batch_rows=1)
        unbatched.start(inline=True, inline_max_elements=16)
        assert unbatched.inline and unbatched.run_now(x()) is not None
        unbatched.close()
        batched = queue(inst)
        batched.start(inline=True, inline_max_elements=16)
        assert not batched.inline  # batches form in its queue, which a run on the loop never fills
        batched.close()

    asyncio.run(main())
