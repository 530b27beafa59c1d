"""The scheduler's logic with a fake instance (pure logic: batching, deadlines, busy, close)."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

import numpy as np
import pytest

from edged.backends.base import Instance
from edged.errors import BusyError, DeadlineExceededError, ShuttingDownError
from edged.serving.scheduler import ModelQueue

T = TypeVar("T")


class FakeInstance(Instance):
    """Doubles its input; records the batch sizes it ran; can be held by a gate."""

    def __init__(self) -> None:
        self.batches: list[int] = []
        self.gate = threading.Event()
        self.gate.set()

    def infer(self, inputs: Mapping[str, np.ndarray], checked: bool = False) -> dict[str, np.ndarray]:
        return self._infer_impl(inputs)

    def _infer_impl(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        assert self.gate.wait(30)
        self.batches.append(len(inputs["x"]))
        return {"y": inputs["x"] * 2}


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def test_batches_concurrent_requests_and_splits_results() -> None:
    inst = FakeInstance()

    async def main() -> list[np.ndarray]:
        q = ModelQueue(
            "m", [inst], asyncio.get_running_loop(), depth=64, max_batch=8, max_queue_delay_us=200_000, batchable=True
        )
        inst.gate.clear()  # hold the worker so requests pile up
        q.start()
        tasks = [asyncio.ensure_future(q.submit({"x": np.full((1, 2), i, np.float32)}, 10)) for i in range(9)]
        while q.backlog < 9:
            await asyncio.sleep(0)
        inst.gate.set()
        out = [r["y"] for r in await asyncio.gather(*tasks)]
        q.close()
        return out

    outs = run(main())
    assert [float(o[0, 0]) for o in outs] == [2.0 * i for i in range(9)]
    assert sum(inst.batches) == 9 and max(inst.batches) <= 8 and len(inst.batches) < 9


def test_different_shapes_are_not_mixed() -> None:
    inst = FakeInstance()

    async def main() -> None:
        q = ModelQueue(
            "m", [inst], asyncio.get_running_loop(), depth=64, max_batch=8, max_queue_delay_us=50_000, batchable=True
        )
        inst.gate.clear()
        q.start()
        a = asyncio.ensure_future(q.submit({"x": np.ones((1, 2), np.float32)}, 10))
        b = asyncio.ensure_future(q.submit({"x": np.ones((1, 3), np.float32)}, 10))
        while q.backlog < 2:
            await asyncio.sleep(0)
        inst.gate.set()
        ra, rb = await asyncio.gather(a, b)
        assert ra["y"].shape == (1, 2) and rb["y"].shape == (1, 3)
        q.close()

    run(main())
    assert inst.batches == [1, 1]


def test_full_queue_is_busy_at_once_and_deadline_is_honoured() -> None:
    inst = FakeInstance()

    async def main() -> None:
        q = ModelQueue("m", [inst], asyncio.get_running_loop(), depth=2)
        inst.gate.clear()
        q.start()
        first = asyncio.ensure_future(q.submit({"x": np.ones((1, 1))}, 10))
        queued = asyncio.ensure_future(q.submit({"x": np.ones((1, 1))}, 0.05))
        while q.backlog < 2:
            await asyncio.sleep(0)
        with pytest.raises(BusyError, match="queue is full"):
            await q.submit({"x": np.ones((1, 1))}, 10)
        with pytest.raises(DeadlineExceededError):
            await queued
        inst.gate.set()
        assert (await first)["y"][0, 0] == 2
        q.close()
        with pytest.raises(ShuttingDownError):
            await q.submit({"x": np.ones((1, 1))}, 10)

    run(main())
    assert inst.batches == [1]  # the expired request never ran


def test_wedged_worker_is_unhealthy() -> None:
    inst = FakeInstance()

    async def main() -> None:
        q = ModelQueue("m", [inst], asyncio.get_running_loop(), depth=4)
        q.start()
        inst.gate.clear()  # the instance hangs, as a wedged GPU call would
        task = asyncio.ensure_future(q.submit({"x": np.ones((1, 1))}, 10))
        while all(w.busy_since is None for w in q.workers):
            await asyncio.sleep(0.001)
        assert q.healthy(60)
        assert not q.healthy(0.0)
        inst.gate.set()
        await task
        assert q.healthy(0.0)
        q.close()

    run(main())


def test_timed_out_requests_leave_the_queue_and_free_their_inputs() -> None:
    """queue_depth is a real bound: before, 199 timed-out items (and their inputs) stayed queued
    behind a depth of 4 while the worker was busy."""
    inst = FakeInstance()
    refs: list[weakref.ref[np.ndarray]] = []

    async def main() -> None:
        q = ModelQueue("m", [inst], asyncio.get_running_loop(), depth=4)
        inst.gate.clear()
        q.start()
        running = asyncio.ensure_future(q.submit({"x": np.ones((1, 1))}, 30))
        while not q.workers[0].busy_since:
            await asyncio.sleep(0.001)
        for _ in range(200):
            x = np.ones((1, 1))
            refs.append(weakref.ref(x))
            with pytest.raises(DeadlineExceededError):
                await q.submit({"x": x}, 0.001)
            del x
            assert q.backlog == 1  # only the running request holds a slot
        # The deadline cancels the request's future, whose callbacks the loop runs on its next
        # turn: until then they hold the last request's future (and, through it, its inputs).
        await asyncio.sleep(0)
        gc.collect()
        assert all(r() is None for r in refs), "a timed-out request's inputs are still held"
        # Three more fit at once (depth 4); the fifth is busy at once.
        more = [asyncio.ensure_future(q.submit({"x": np.ones((1, 1))}, 30)) for _ in range(3)]
        await asyncio.sleep(0)
        assert q.backlog == 4
        with pytest.raises(BusyError):
            await q.submit({"x": np.ones((1, 1))}, 30)
        inst.gate.set()
        await asyncio.gather(running, *more)
        assert q.backlog == 0
        q.close()

    run(main())
    assert inst.batches == [1, 1, 1, 1]


def test_cancelled_request_gives_its_slot_back() -> None:
    inst = FakeInstance()

    async def main() -> None:
        q = ModelQueue("m", [inst], asyncio.get_running_loop(), depth=2)
        inst.gate.clear()
        q.start()
        running = asyncio.ensure_future(q.submit({"x": np.ones((1, 1))}, 30))
        queued = asyncio.ensure_future(q.submit({"x": np.ones((1, 1))}, 30))
        while q.backlog < 2:
            await asyncio.sleep(0)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert q.backlog == 1
        inst.gate.set()
        await running
        q.close()

    run(main())
    assert inst.batches == [1]


class ThreadRecordingInstance(FakeInstance):
    def __init__(self) -> None:
        super().__init__()
        self.ran_on: list[int] = []

    def _infer_impl(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.ran_on.append(threading.get_ident())
        return super()._infer_impl(inputs)


def test_inline_model_runs_only_bounded_requests_on_the_loop() -> None:
    inst = ThreadRecordingInstance()
    loop_thread = threading.get_ident()

    async def main() -> None:
        q = ModelQueue("m", [inst], asyncio.get_running_loop(), depth=8)
        q.start(inline=True, inline_max_elements=4)
        await q.submit({"x": np.ones((2, 2))}, 10)  # 4 elements: on the loop
        assert inst.ran_on == [loop_thread]
        await q.submit({"x": np.ones((3, 2))}, 10)  # 6 elements: a worker's job
        assert inst.ran_on[1] != loop_thread
        # While the worker runs a large request on the shared instance, a small one does not
        # overlap it on the loop (nor block the loop waiting): it queues behind it.
        inst.gate.clear()
        big = asyncio.ensure_future(q.submit({"x": np.ones((100, 2))}, 10))
        while not q.workers[0].busy_since:
            await asyncio.sleep(0.001)
        small = asyncio.ensure_future(q.submit({"x": np.ones((1, 2))}, 10))
        await asyncio.sleep(0.01)
        assert not small.done()
        inst.gate.set()
        await asyncio.gather(big, small)
        assert loop_thread not in inst.ran_on[2:]
        q.close()

    run(main())


def test_bytes_tensors_never_run_on_the_loop() -> None:
    """One BYTES element may hold megabytes that the backend converts: never inline, whatever
    the element count."""
    inst = ThreadRecordingInstance()
    loop_thread = threading.get_ident()

    async def main() -> None:
        q = ModelQueue("m", [inst], asyncio.get_running_loop(), depth=8)
        q.start(inline=True, inline_max_elements=10**6)
        await q.submit({"x": np.ones((1, 2), np.float32)}, 10)
        await q.submit({"x": np.array([[b"ab", b"cd"]], dtype=object)}, 10)
        q.close()

    run(main())
    assert inst.ran_on[0] == loop_thread and inst.ran_on[1] != loop_thread


def _held_queue(depth: int = 8) -> tuple[FakeInstance, ModelQueue]:
    inst = FakeInstance()
    inst.gate.clear()
    q = ModelQueue("m", [inst], asyncio.get_running_loop(), depth=depth)
    q.start()
    return inst, q


async def _deadlines(n: int, timeout: float) -> tuple[dict[str, int], int]:
    inst, q = _held_queue(depth=n + 2)
    running = asyncio.ensure_future(q.submit({"x": np.ones((1, 1))}, 30))  # holds the worker
    while not q.workers[0].busy_since:
        await asyncio.sleep(0.001)
    outcomes = {"deadline": 0, "cancelled": 0}
    for _ in range(n):
        try:
            await q.submit({"x": np.ones((1, 1))}, timeout)
        except DeadlineExceededError:
            outcomes["deadline"] += 1
        except asyncio.CancelledError:  # nobody cancelled this task: a deadline misread
            outcomes["cancelled"] += 1
    backlog = q.backlog
    inst.gate.set()
    await running
    q.close()
    return outcomes, backlog


@pytest.mark.parametrize("timeout", [0.01, 0.05])
def test_every_deadline_under_uvloop_is_a_deadline(timeout: float) -> None:
    """uvloop keeps whole milliseconds: told from the loop's clock, a deadline can read as 'not
    yet' when its timer fires (for 20-35% of requests), and the request would end as
    CancelledError (a 500 over HTTP, no answer and no acknowledgement over MQTT). The timer marks
    the request it expired: every one is a deadline."""
    import uvloop

    outcomes, backlog = uvloop.run(_deadlines(40 if timeout < 0.05 else 12, timeout))
    assert outcomes["cancelled"] == 0, outcomes
    assert backlog == 1  # only the running request holds a slot


def test_a_caller_cancelled_past_its_deadline_before_the_timer_ran_stays_cancelled() -> None:
    """The loop busy past the deadline, then the caller goes away (connection_lost, a stop) before
    the timer runs: the cancellation is the caller's and must propagate, not turn into an
    answer."""

    async def main() -> None:
        inst, q = _held_queue()
        task = asyncio.ensure_future(q.submit({"x": np.ones((1, 1))}, 0.01))
        await asyncio.sleep(0)  # submit awaits its future now
        time.sleep(0.03)  # the loop held past the deadline (what is measured, not synchronisation)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        inst.gate.set()
        q.close()

    run(main())


def test_a_run_that_ends_after_the_loop_closed_drops_its_answer_quietly() -> None:
    """The daemon exits while a worker still runs a request: its answer has nobody to go to, and
    the worker must not die with a traceback (call_soon_threadsafe raises on a closed loop)."""
    inst = FakeInstance()
    failures: list[BaseException | None] = []
    hook = threading.excepthook
    threading.excepthook = lambda args: failures.append(args.exc_value)
    loop = asyncio.new_event_loop()
    try:
        q = ModelQueue("m", [inst], loop, depth=4)

        async def main() -> None:
            q.start()
            inst.gate.clear()
            task = asyncio.ensure_future(q.submit({"x": np.ones((1, 1))}, 10))
            while all(w.busy_since is None for w in q.workers):
                await asyncio.sleep(0.001)
            task.cancel()  # the caller goes away as the daemon stops
            await asyncio.gather(task, return_exceptions=True)

        loop.run_until_complete(main())
        loop.close()
        q.close()
        inst.gate.set()  # the run ends after the loop has closed
        for t in q._threads:
            t.join(10)
            assert not t.is_alive()
    finally:
        threading.excepthook = hook
        inst.gate.set()
        if not loop.is_closed():
            loop.close()
    assert failures == []
    assert inst.batches == [1]


class RecordingSink:
    """An OutputSink that records where and with what the worker called it (pure logic)."""

    def __init__(self, seen: list[tuple[str, int, Mapping[str, np.ndarray]]]) -> None:
        self.seen = seen

    def bind(self, shapes: Mapping[str, Any], inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.seen.append(("bind", threading.get_ident(), dict(shapes)))
        return {}

    def run(self, results: Mapping[str, np.ndarray]) -> None:
        self.seen.append(("run", threading.get_ident(), results))


def test_the_workers_sink_gets_that_requests_results_on_the_worker() -> None:
    inst = ThreadRecordingInstance()
    inst.runs_into = True
    loop_thread = threading.get_ident()
    seen: list[tuple[str, int, Mapping[str, np.ndarray]]] = []

    async def main() -> None:
        q = ModelQueue("m", [inst], asyncio.get_running_loop(), depth=8)
        q.start(inline=True, inline_max_elements=4)
        await q.submit({"x": np.ones((2, 2))}, 10, sink=RecordingSink(seen))  # on the loop: no sink
        assert seen == []
        out = await q.submit({"x": np.ones((3, 2))}, 10, sink=RecordingSink(seen))
        assert [s[0] for s in seen] == ["bind", "run"] and seen[1][2] is out
        assert seen[0][2] == {}, "no shapes known before the first run of these input shapes"
        assert seen[1][1] == inst.ran_on[-1] != loop_thread
        await q.submit({"x": np.ones((3, 2))}, 10, sink=RecordingSink(seen))
        assert seen[2][0] == "bind" and seen[2][2] == {"y": ((3, 2), np.dtype(np.float64))}
        q.close()

    run(main())


def test_each_request_of_a_batch_gets_its_own_slice_in_its_sink() -> None:
    inst = FakeInstance()
    seen: dict[int, list[tuple[str, int, Mapping[str, np.ndarray]]]] = {i: [] for i in range(4)}

    async def main() -> None:
        q = ModelQueue(
            "m", [inst], asyncio.get_running_loop(), depth=64, max_batch=4, max_queue_delay_us=200_000, batchable=True
        )
        inst.gate.clear()
        q.start()
        tasks = [
            asyncio.ensure_future(q.submit({"x": np.full((1, 2), i, np.float32)}, 10, sink=RecordingSink(seen[i])))
            for i in range(4)
        ]
        while q.backlog < 4:
            await asyncio.sleep(0)
        inst.gate.set()
        outs = await asyncio.gather(*tasks)
        q.close()
        assert max(inst.batches) > 1, "the requests were not batched"
        for i, out in enumerate(outs):
            ((kind, _, results),) = seen[i]  # a batch is never run into a request's arrays
            assert kind == "run" and results is out and out["y"].tolist() == [[2.0 * i, 2.0 * i]]

    run(main())
