"""Per-model queues, batching, deadlines and the worker threads that run inference.

Each model has one bounded queue and one worker thread per instance (each instance owns its
execution context, so no locks around inference). The event loop only enqueues and is woken once
per finished batch through ``call_soon_threadsafe``. A model whose inference is cheaper than that
hand-off (tens of microseconds on a small board) runs inline on the loop instead, but only for
requests no larger than the warm-up measured (``inline_max_elements``): a larger request, whose
cost grows with it, goes to the model's worker thread like any other.

``queue_depth`` bounds what a model holds: requests queued or running. A request whose caller
timed out or went away is taken out of the queue at once, so it holds neither a slot nor its
inputs.

Dynamic batching never holds a request for company it may not get: a request that finds an
instance idle runs at once, alone. Requests that arrive while every instance is busy queue, and
the next instance to finish takes the oldest with every queued request of the same input shapes
(up to ``batch_rows`` rows: ``max_batch``, or less where the warm-up measured that a larger batch
does not help, edged/serving/batchfit.py), concatenates them along the batch axis, runs once and
splits the outputs. With preferred batch sizes it runs the longest run of them, from the oldest,
that makes a preferred size (edged/serving/batching.py); a batch of several requests that makes
none may wait for more, until its oldest request has been queued ``max_queue_delay_us``. A batch
of one request never waits: under load the queue fills while the instances run, so waiting only
pays where a preferred size is worth a delay to the requests already gathered.

What a worker does with the batch it took (the copy in, the run, the split, the sinks) is
edged/serving/runs.py's; this module owns the queue, its bounds and the hand-back to the loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from time import perf_counter_ns
from typing import TYPE_CHECKING

import numpy as np

from edged.backends.base import Instance
from edged.errors import BusyError, DeadlineExceededError, ShuttingDownError
from edged.serving.batching import add_compatible, preferred_cut
from edged.serving.runs import Done, Timing, Work, WorkerState, fill, rows_of, run_batch
from edged.serving.sinks import InputSource, OutputShapes, OutputSink
from edged.thread_to_loop import to_loop
from edged.wire.tensors import is_bytes

if TYPE_CHECKING:
    from edged.serving.stats import ModelStatistics

log = logging.getLogger(__name__)

# Names of the per-instance worker threads (stack dumps, and the tests' fault injection).
WORKER_THREAD_PREFIX = "edged-worker-"

Tensors = Mapping[str, np.ndarray]


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
        preferred: Sequence[int] = (),
        batch_rows: int | None = None,
    ) -> None:
        """``max_batch``: the most rows a request may carry; ``batch_rows``: the most a batch
        formed of several requests may (None: ``max_batch``; 1: every request runs alone)."""
        self.model = model
        self._instances = list(instances)
        self._loop = loop
        self.depth = depth
        self.max_batch = max_batch if batchable else 1
        self.batch_rows = max(1, min(self.max_batch if batch_rows is None else batch_rows, self.max_batch))
        self.max_delay_ns = max_queue_delay_us * 1000
        self.preferred = tuple(sorted(n for n in set(preferred) if n <= self.batch_rows))
        self._queue: collections.deque[Work] = collections.deque()
        self._cond = threading.Condition()
        self._backlog = 0  # requests queued or running; only touched on the loop
        self._closed = False
        self.inline = False
        self.inline_max_elements = 0
        self._inline_instance: Instance | None = None
        # The inline instance is also the worker's: whoever holds this runs it. The loop never
        # waits for it (a busy worker sends the request to the queue instead).
        self._inline_lock = threading.Lock()
        self.workers = [WorkerState(f"{model}#{i}") for i in range(len(self._instances))]
        self._shapes = OutputShapes()  # learnt from runs with an OutputSink, for its ``bind``
        self._threads: list[threading.Thread] = []

    # --- lifecycle ---

    def start(self, inline: bool = False, inline_max_elements: int = 0) -> None:
        """Every instance gets a worker thread. An inline model also runs requests of at most
        ``inline_max_elements`` input elements (the warm-up's size) on the loop, with the first
        instance; 0 means the size of the instance's static input shapes, dynamic axes as 1."""
        self.inline = inline and self.batch_rows == 1  # a model run on the loop never queues to batch
        if self.inline:
            self._inline_instance = self._instances[0]
            self.inline_max_elements = inline_max_elements or _static_elements(self._instances[0])
        for inst, state in zip(self._instances, self.workers):
            t = threading.Thread(
                target=self._worker, args=(inst, state), name=f"{WORKER_THREAD_PREFIX}{state.name}", daemon=True
            )
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
    def idle(self) -> bool:
        """An instance is free: a request submitted now is the next its worker runs."""
        return self._backlog < len(self._instances) and not self._closed

    @property
    def backlog(self) -> int:
        """Requests this model holds, queued or running (what ``queue_depth`` bounds)."""
        return self._backlog

    def healthy(self, stall_timeout: float) -> bool:
        now = time.monotonic()
        return all(w.busy_since is None or now - w.busy_since < stall_timeout for w in self.workers)

    # --- submitting (on the loop) ---

    def run_now(
        self, inputs: Tensors, stats: ModelStatistics | None = None, elements: int | None = None
    ) -> dict[str, np.ndarray] | None:
        """The answer at once, on the loop, for a request an inline model runs there (no larger
        than the warm-up's, the instance free, a slot of queue_depth left); None for any other
        request, which ``submit`` queues (or refuses). Callers on the loop try this first, so a
        request answered at once pays for no coroutine and no future. ``elements``: the inputs'
        ``elements_of``, where the caller has it."""
        inst = self._inline_instance
        if (
            inst is None
            or self._backlog >= self.depth
            or (elements_of(inputs) if elements is None else elements) > self.inline_max_elements
            or not self._inline_lock.acquire(False)
        ):
            return None
        # Synchronous on the loop, bounded by the warm-up's size; the lock keeps the worker
        # (running a larger request on the same instance) from overlapping it.
        try:
            started = perf_counter_ns()
            out = inst.infer(inputs, checked=True)
        finally:
            self._inline_lock.release()
        if stats is not None:  # never queued: a wait of 0, a batch of its own rows
            stats.ran_alone(perf_counter_ns() - started, rows_of(inputs) if self.max_batch > 1 else 1)
        return out

    async def submit(
        self,
        inputs: Tensors,
        timeout: float,
        request_id: str = "",
        stats: ModelStatistics | None = None,
        sink: OutputSink | None = None,
        source: InputSource | None = None,
    ) -> dict[str, np.ndarray]:
        """``sink``: where the worker puts the outputs (not used by a run made here, on the loop);
        ``source``: where the worker copies the inputs' bytes from first (such a request never
        runs on the loop: its copy is the worker's)."""
        out = self.run_now(inputs, stats) if source is None else None
        if out is not None:
            return out
        if self._closed:
            raise ShuttingDownError(f"model '{self.model}' is not serving")
        if self._backlog >= self.depth:
            raise BusyError(f"model '{self.model}' queue is full ({self.depth} requests)")
        fut: asyncio.Future[dict[str, np.ndarray]] = self._loop.create_future()
        work = Work(
            inputs,
            time.monotonic() + timeout,
            fut,
            request_id,
            stats=stats,
            enqueued_ns=perf_counter_ns(),
            sink=sink,
            source=source,
        )
        if self.max_batch > 1:  # the first dimension is a batch: its rows are what the statistics count
            work.rows = rows_of(inputs)
        if self.batch_rows > 1:
            work.signature = tuple((k, v.shape[1:], v.dtype.str) for k, v in inputs.items())
        self._backlog += 1
        with self._cond:
            self._queue.append(work)
            self._cond.notify()
        # The deadline is a timer that cancels the future and marks the request, not wait_for
        # around a shield (7-8 us more per request on the 2-core machine). The mark, not the
        # loop's clock, tells a deadline from the caller's own cancellation: uvloop keeps whole
        # milliseconds, and a clock test read 20-35% of deadlines as cancellations. The error is
        # raised here, not stored in the future: one stored there would hold this frame, and the
        # request's inputs, in a cycle. A caller cancelled while waiting cancels the future
        # too: the worker's settle skips a future that is done.
        timer = self._loop.call_later(timeout, _expire, work)
        answered = False
        try:
            out = await fut
            answered = True
            return out
        except asyncio.CancelledError:
            if not work.expired or _cancelling():
                raise  # the caller was cancelled (gone, or the daemon stopping)
        finally:
            timer.cancel()
            if not answered:  # timed out, cancelled or failed
                work.stats = None  # a failure for the statistics: its stages are not a success's
                self._withdraw(work)  # drop it if no worker has it yet (a no-op once one has)
        # Raised outside the handler, so that it carries no CancelledError as its context.
        raise DeadlineExceededError(f"model '{self.model}': no result within {timeout * 1000:.0f} ms")

    def _withdraw(self, work: Work) -> None:
        with self._cond:
            try:
                self._queue.remove(work)  # at most queue_depth items: bounded
            except ValueError:
                return  # a worker is running it: its slot is released when it finishes
        self._release(work)

    def _release(self, work: Work) -> None:
        if not work.released:
            work.released = True
            self._backlog -= 1

    # --- workers (threads) ---

    def _take(self, state: WorkerState) -> list[Work] | None:
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            first = self._queue.popleft()
            batch = [first]
            if self.batch_rows > 1:
                self._gather(batch, state)
            return batch

    def _gather(self, batch: list[Work], state: WorkerState) -> None:
        """With the condition held: add the queued requests of the first's shapes, never past
        ``batch_rows`` rows; with preferred sizes, run the longest preferred run of them, and let
        a batch of several requests that makes none wait for more until its oldest request has
        been queued ``max_queue_delay_us`` (or reaches its deadline), counted in ``state.waits``."""
        first = batch[0]
        rows = first.rows
        top = self.preferred[-1] if self.preferred else self.batch_rows
        waited = False
        while True:
            rows, blocked = add_compatible(self._queue, batch, rows, self.batch_rows)
            if self.preferred:
                cut = preferred_cut([w.rows for w in batch], self.preferred, top)
                if cut:
                    self._queue.extendleft(reversed(batch[cut:]))  # the rest, first in line again
                    del batch[cut:]
                    return
            # Without preferred sizes every batch is what queued while the instances were busy:
            # under load that fills it, and without load a wait only delays the requests held.
            if not self.preferred or len(batch) < 2 or rows >= top or blocked or self._closed:
                return
            left_ns = min(first.enqueued_ns + self.max_delay_ns - perf_counter_ns(), _ns(first.deadline))
            if left_ns <= 0:
                return
            if not waited:
                waited = True
                state.waits += 1
            self._cond.wait(left_ns / 1e9)

    def _worker(self, inst: Instance, state: WorkerState) -> None:
        while True:
            batch = self._take(state)
            if batch is None:
                return
            self._serve(inst, state, batch)
            # Not kept while idle: the last request's inputs may be a frame, or a view of a
            # client's mapped region that its unregistration is waiting to unmap.
            del batch

    def _serve(self, inst: Instance, state: WorkerState, batch: list[Work]) -> None:
        taken = perf_counter_ns()
        for w in batch:
            w.queue_ns = taken - w.enqueued_ns
        now = time.monotonic()
        live = []
        for w in batch:
            if now > w.deadline:
                self._resolve(w, None, DeadlineExceededError(f"model '{self.model}': deadline passed while queued"))
            elif w.source is None:
                live.append(w)
            else:
                err = fill(self.model, w)
                if err is None:
                    live.append(w)
                else:
                    self._resolve(w, None, err)
        if not live:
            return
        state.busy_since = time.monotonic()
        try:
            with self._inline_lock if inst is self._inline_instance else contextlib.nullcontext():
                done, timing = run_batch(self.model, inst, live, self._shapes)
        finally:
            state.busy_since = None
            state.batches += 1
            state.rows += sum(w.rows for w in live)
        # Answered only once the worker is idle again: whoever sees the answer sees it idle.
        self._resolve_all(done, timing)

    def _resolve(self, w: Work, result: dict[str, np.ndarray] | None, err: BaseException | None) -> None:
        self._resolve_all([(w, result, err)])

    def _resolve_all(self, done: Sequence[Done], timing: Timing | None = None) -> None:
        """Hand results to the loop: one wake-up per batch, not one per request. ``timing``:
        a successful run's figures, added to the statistics there (only the loop writes them)."""

        def settle() -> None:
            stats = None
            for w, result, err in done:
                self._release(w)
                if w.stats is not None and err is None:
                    stats = w.stats  # the run happened, whether or not its requester still waits
                if w.future.done():
                    continue
                if err is not None:
                    w.future.set_exception(err)
                else:
                    assert result is not None
                    w.future.set_result(result)
                    if w.stats is not None:
                        w.stats.ran(w.queue_ns, w.infer_ns, w.rows)
            if stats is not None and timing is not None:
                stats.executed(*timing)

        if not to_loop(self._loop, settle):  # the daemon is exiting: nobody waits for these
            log.debug("%s: %d answers dropped, the event loop has closed", self.model, len(done))

    def batch_stats(self) -> dict[str, int]:
        """Runs on worker threads, rows they ran, and batches that waited for company."""
        workers = self.workers
        return {
            "batches": sum(w.batches for w in workers),
            "rows": sum(w.rows for w in workers),
            "batch_waits": sum(w.waits for w in workers),
        }


def _ns(deadline: float) -> int:
    """Nanoseconds until a ``time.monotonic()`` deadline."""
    return int((deadline - time.monotonic()) * 1e9)


def _expire(work: Work) -> None:
    if work.future.cancel():  # False once answered or cancelled by its caller: that stands
        work.expired = True


def _cancelling() -> bool:
    """The current task is being cancelled as well (Python 3.11+ can tell; 3.10 cannot): a
    caller cancelled after its deadline's timer ran, before it resumed."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return bool(cancelling()) if cancelling is not None else False


def elements_of(inputs: Tensors) -> int:
    """What the inline bound compares; a BYTES tensor never runs on the loop (one element may
    hold megabytes, which its conversion walks: 181 ms for one 32 MiB element)."""
    total = 0
    for a in inputs.values():
        if is_bytes(a.dtype):
            return 1 << 62
        total += a.size
    return total


def _static_elements(inst: Instance) -> int:
    """Input elements at the model's static shape, dynamic axes counted as 1."""
    return sum(math.prod(max(d, 1) for d in spec.shape) for spec in inst.backend.inputs)
