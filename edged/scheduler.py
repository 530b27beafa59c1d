"""Per-model queues, batching, deadlines and the worker threads that run inference.

Each model has one bounded queue and one worker thread per instance (each instance owns its
execution context, so no locks around inference). The event loop only enqueues and is woken once
per finished batch through ``call_soon_threadsafe``. A model whose inference is cheaper than that
hand-off (tens of microseconds on a small board) runs inline on the loop instead.

Dynamic batching: a worker that takes a request looks for more queued requests with the same
input shapes, waiting at most ``max_queue_delay_us`` for company, concatenates them along the
batch axis, runs once and splits the outputs.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from edged.backends.base import Instance
from edged.errors import BusyError, DeadlineExceededError, EdgedError, ShuttingDownError

log = logging.getLogger(__name__)

Tensors = Mapping[str, np.ndarray]


@dataclass(eq=False)
class _Work:
    inputs: Tensors
    deadline: float  # time.monotonic()
    future: asyncio.Future[dict[str, np.ndarray]]
    request_id: str
    rows: int = 1
    signature: tuple[tuple[str, tuple[int, ...], str], ...] = field(default=())


@dataclass
class WorkerState:
    """What the watchdog reads: a worker stuck on one batch for too long is unhealthy."""

    name: str
    busy_since: float | None = None
    batches: int = 0
    rows: int = 0


class ModelQueue:
    def __init__(
        self,
        model: str,
        instances: Sequence[Instance],
        loop: asyncio.AbstractEventLoop,
        depth: int,
        max_batch: int = 1,
        max_queue_delay_us: int = 0,
        batchable: bool = False,
    ) -> None:
        self.model = model
        self._instances = list(instances)
        self._loop = loop
        self.depth = depth
        self.max_batch = max_batch if batchable else 1
        self.max_delay = max_queue_delay_us / 1e6
        self._queue: collections.deque[_Work] = collections.deque()
        self._cond = threading.Condition()
        self._pending = 0  # queued + running; only touched on the loop
        self._closed = False
        self.inline = False
        self._inline_instance: Instance | None = None
        self.workers = [WorkerState(f"{model}#{i}") for i in range(len(self._instances))]
        self._threads: list[threading.Thread] = []
        self.fault_wedge = threading.Event()  # test-only fault switch (EDGED_TEST_FAULTS)

    # --- lifecycle ---

    def start(self, inline: bool = False) -> None:
        """Inline models run on the loop with the first instance; the rest get worker threads."""
        self.inline = inline and self.max_batch == 1
        if self.inline:
            self._inline_instance = self._instances[0]
            return
        for inst, state in zip(self._instances, self.workers):
            t = threading.Thread(target=self._worker, args=(inst, state), name=f"edged-{state.name}", daemon=True)
            t.start()
            self._threads.append(t)

    def close(self, reason: str = "model unloaded") -> None:
        """Stop the workers; queued requests fail with ShuttingDownError."""
        self._inline_instance = None
        with self._cond:
            self._closed = True
            dropped = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for w in dropped:
            self._resolve(w, None, ShuttingDownError(f"{self.model}: {reason}"))

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    @property
    def pending(self) -> int:
        return self._pending

    def healthy(self, stall_timeout: float) -> bool:
        now = time.monotonic()
        return all(w.busy_since is None or now - w.busy_since < stall_timeout for w in self.workers)

    # --- submitting (on the loop) ---

    async def submit(self, inputs: Tensors, timeout: float, request_id: str = "") -> dict[str, np.ndarray]:
        if self._closed:
            raise ShuttingDownError(f"model '{self.model}' is not serving")
        if self._pending >= self.depth:
            raise BusyError(f"model '{self.model}' queue is full ({self.depth} requests)")
        if self._inline_instance is not None:
            # Synchronous on the loop: nothing else runs meanwhile, so it never overlaps itself.
            return self._inline_instance.infer(inputs, checked=True)
        fut: asyncio.Future[dict[str, np.ndarray]] = self._loop.create_future()
        work = _Work(inputs, time.monotonic() + timeout, fut, request_id)
        if self.max_batch > 1:
            work.signature = tuple((k, v.shape[1:], v.dtype.str) for k, v in inputs.items())
            work.rows = next(iter(inputs.values())).shape[0] if inputs else 1
        self._pending += 1
        try:
            with self._cond:
                self._queue.append(work)
                self._cond.notify()
            try:
                return await asyncio.wait_for(asyncio.shield(fut), timeout)
            except asyncio.TimeoutError:
                raise DeadlineExceededError(f"model '{self.model}': no result within {timeout * 1000:.0f} ms") from None
        finally:
            self._pending -= 1

    # --- workers (threads) ---

    def _take(self) -> list[_Work] | None:
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            first = self._queue.popleft()
            batch = [first]
            if self.max_batch > 1:
                self._gather(batch)
            return batch

    def _gather(self, batch: list[_Work]) -> None:
        """With the condition held: add queued requests of the same shapes, waiting up to the
        configured delay for company, never past ``max_batch`` rows."""
        first = batch[0]
        rows = first.rows
        # Never hold a request past its own deadline waiting for company.
        until = min(time.monotonic() + self.max_delay, first.deadline)
        while rows < self.max_batch:
            blocked = False
            for w in list(self._queue):
                if w.signature != first.signature:
                    continue
                if rows + w.rows > self.max_batch:
                    blocked = True  # the next compatible request does not fit: run what we have
                    continue
                self._queue.remove(w)
                batch.append(w)
                rows += w.rows
                if rows >= self.max_batch:
                    return
            left = until - time.monotonic()
            if blocked or left <= 0 or self._closed:
                return
            self._cond.wait(left)

    def _worker(self, inst: Instance, state: WorkerState) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            now = time.monotonic()
            live = []
            for w in batch:
                if now > w.deadline:
                    self._resolve(w, None, DeadlineExceededError(f"model '{self.model}': deadline passed while queued"))
                else:
                    live.append(w)
            if not live:
                continue
            state.busy_since = time.monotonic()
            try:
                while self.fault_wedge.is_set():  # test-only: simulate a wedged worker
                    time.sleep(0.05)
                self._run(inst, live)
            finally:
                state.busy_since = None
                state.batches += 1
                state.rows += sum(w.rows for w in live)

    def _run(self, inst: Instance, batch: list[_Work]) -> None:
        try:
            if len(batch) == 1:
                self._resolve(batch[0], inst.infer(batch[0].inputs, checked=True), None)
                return
            names = list(batch[0].inputs)
            joined = {n: np.concatenate([w.inputs[n] for w in batch]) for n in names}
            out = inst.infer(joined, checked=True)
            results, start = [], 0
            for w in batch:
                end = start + w.rows
                results.append((w, {k: v[start:end] for k, v in out.items()}, None))
                start = end
            self._resolve_all(results)
        except EdgedError as e:
            self._resolve_all([(w, None, e) for w in batch])
        except Exception as e:  # never let one request kill a worker
            log.exception("worker failed", extra={"model": self.model})
            self._resolve_all([(w, None, e) for w in batch])

    def _resolve(self, w: _Work, result: dict[str, np.ndarray] | None, err: BaseException | None) -> None:
        self._resolve_all([(w, result, err)])

    def _resolve_all(self, done: Sequence[tuple[_Work, dict[str, np.ndarray] | None, BaseException | None]]) -> None:
        """Hand results to the loop: one wake-up per batch, not one per request."""

        def settle() -> None:
            for w, result, err in done:
                if w.future.done():
                    continue
                if err is not None:
                    w.future.set_exception(err)
                else:
                    assert result is not None
                    w.future.set_result(result)

        self._loop.call_soon_threadsafe(settle)

    def batch_stats(self) -> dict[str, int]:
        return {"batches": sum(w.batches for w in self.workers), "rows": sum(w.rows for w in self.workers)}
