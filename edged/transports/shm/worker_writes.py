"""Outputs bound for shared memory, written by the model's worker thread right after its run.

Written by the encoder instead, back on the loop, a frame-sized output goes out to a copier
thread and back: two more thread wake-ups and a copy of data the run left in other cores' caches
(a detector's 1.6 MB answer took 0.55 ms of its request that way on a 16-core host). The worker
is awake and off the loop already, so it writes there.

The destinations are taken on the loop before the run (copies.ShmRequest.write_early), for the
size the request gave. The worker writes each output of a fixed-size type that fits; the
encoder, on the loop, claims each output in the request's order and finds it written, or writes
it itself (an output the worker skipped, a run made on the loop, a write that failed: the
encoder then raises the worker's error). A lock makes the worker's writes and the request's
release exclusive: a request released before its worker starts writing (answered without the
worker, failed, cancelled) is never written, and one released during the writes keeps its
regions until they end, so a descriptor is never closed or a mapping unmapped under a write.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edged.errors import EdgedError
from edged.thread_to_loop import to_loop
from edged.transports.shm.regions import Region
from edged.wire.tensors import is_bytes, tensor_bytes

# (region, position in its object, bytes): the kernel's write to a region that is not mapped.
Writer = Callable[[Region, int, np.ndarray], None]

_NEW, _WRITING, _DONE, _DROPPED = range(4)

# An output at least this large is run straight into its mapped region (ONNX Runtime's I/O
# binding): below it, the binding's own calls (20-40 us) cost more than the copy they save.
BIND_BYTES = 256 * 1024


@dataclass(eq=False)
class Target:
    """One output's destination, held (``Region.users``) by the request."""

    output: str
    region_name: str
    offset: int  # in the region, as the request gave it
    size: int  # the bytes the request gave it
    region: Region
    view: memoryview | None  # the mapped bytes of a sealed memfd; None: written with ``Writer``
    bindable: bool = True  # no input of the request lies in these bytes (a run may write them)


class EarlyWrites:
    def __init__(self, loop: asyncio.AbstractEventLoop, targets: Sequence[Target | None], write: Writer) -> None:
        self._loop = loop
        self._write = write
        self._lock = threading.Lock()
        self._state = _NEW
        self._then: Callable[[], None] | None = None
        # Per output bound for shared memory, in the request's order: its destination (None: left
        # to the encoder), then what the worker did: bytes written, or the error of its write.
        self._targets = list(targets)
        self._done: list[int | BaseException | None] = [None] * len(self._targets)
        self._next = 0  # the encoder's next claim
        self._bound: dict[str, np.ndarray] | None = None  # the arrays ``bind`` gave the run
        self._settled: asyncio.Future[None] | None = None  # ``settled``'s, set when the writes end
        # How long the worker took to write (the statistics' compute_output, with the encoding).
        self.written_ns = 0

    @property
    def complete(self) -> bool:
        """Every output bound for shared memory is written (the encoder has nothing to copy)."""
        return self._state == _DONE and all(isinstance(d, int) for d in self._done)

    def bind(
        self, shapes: Mapping[str, tuple[tuple[int, ...], np.dtype[Any]]], inputs: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """On the worker thread, before the run: arrays over the mapped destinations of outputs
        of at least BIND_BYTES whose shape and type the model is expected to give (``shapes``),
        for the backend to run its answer straight into (Instance.infer_into): no copy at all.
        Never over bytes an input lies in, or another bound output: the run would read what it
        had just written (written after the run instead, they overlap as the client asked).
        The regions are held from here until ``run`` (called whether or not the run succeeds)."""
        into: dict[str, np.ndarray] = {}
        with self._lock:
            if self._state != _NEW:
                return into
            self._state = _WRITING  # a mapping a run writes into is never unmapped under it
        for target in self._targets:
            shape_type = None if target is None else shapes.get(target.output)
            if target is None or target.view is None or not target.bindable or shape_type is None:
                continue
            if target.region.released:
                continue
            shape, dtype = shape_type
            count = math.prod(shape)
            if BIND_BYTES <= count * dtype.itemsize <= target.size and target.output not in into:
                arr = np.frombuffer(target.view, dtype, count).reshape(shape)
                others = [*inputs.values(), *into.values()]
                # Aligned as the backend's own buffers are; overlapping nothing it reads or writes.
                if arr.ctypes.data % 64 == 0 and not any(np.may_share_memory(arr, o) for o in others):
                    into[target.output] = arr
        with self._lock:
            if into or self._then is not None:
                self._bound = into
                return into
            self._state = _NEW  # nothing to bind: the regions are not held through the run
            settled, self._settled = self._settled, None
        if settled is not None:  # asked for while binding: nothing is written during the run
            to_loop(self._loop, _set, settled)
        return into

    def run(self, results: Mapping[str, np.ndarray]) -> None:
        """On the worker thread, right after the run (``results`` empty when it failed). Never
        raises: an error is kept for the encoder to raise, as its own write would have."""
        with self._lock:
            if self._state in (_DONE, _DROPPED):
                return  # released already: the regions may be gone
            self._state = _WRITING
        began = time.perf_counter_ns()
        try:
            for i, target in enumerate(self._targets):
                # One unregistered since (the client gave it up) is not written; the encoder
                # finds its name gone, or naming another region, and answers as it always has.
                if target is not None and not target.region.released:
                    self._done[i] = self._write_one(target, results.get(target.output))
        finally:
            self.written_ns = time.perf_counter_ns() - began
            with self._lock:
                self._state = _DONE
                then, self._then = self._then, None
                self._let_go()
                settled = self._settled
            if then is not None:
                to_loop(self._loop, then)
            if settled is not None:
                to_loop(self._loop, _set, settled)

    def _write_one(self, target: Target, arr: np.ndarray | None) -> int | BaseException | None:
        if arr is None or is_bytes(arr.dtype) or arr.nbytes > target.size:
            return None  # the encoder serialises a BYTES output, or says what is wrong
        if self._bound and self._bound.get(target.output) is arr:
            return int(arr.nbytes)  # the run wrote it there itself
        try:
            data = np.frombuffer(tensor_bytes(arr), np.uint8)
            if target.view is not None:
                np.frombuffer(target.view, np.uint8, data.nbytes)[:] = data
            else:
                self._write(target.region, target.region.offset + target.offset, data)
            return int(data.nbytes)
        except Exception as e:  # raised by the encoder, on the loop, for this output
            return e.with_traceback(None)  # no frame of this thread kept (nor this object, in a cycle)

    def claim(self, region: str, offset: int, size: int, lookup: Callable[[str], Region]) -> bool:
        """The encoder's next output bound for shared memory (the request's order): True when the
        worker wrote exactly these bytes into the region the name still stands for (``lookup``,
        the request's own); raises the worker's error for it."""
        if self._state != _DONE or self._next >= len(self._done):
            return False
        i, self._next = self._next, self._next + 1
        done, target = self._done[i], self._targets[i]
        if target is None or (target.region_name, target.offset) != (region, offset):
            return False
        try:
            if lookup(region) is not target.region:
                return False  # registered again meanwhile: the encoder writes the new one
        except EdgedError:
            return False  # unregistered meanwhile: the encoder says so
        if isinstance(done, BaseException):
            raise done
        return done == size

    def settled(self) -> asyncio.Future[None] | None:
        """On the loop: a future done when the worker's writes end, or None when none are under
        way. A request that fails while its run writes into its region (a deadline) answers
        once the run is over, so a client that reuses the region for its next request never has
        this one's answer land on top of the next one's."""
        with self._lock:
            if self._state != _WRITING:
                return None
            if self._settled is None:
                self._settled = self._loop.create_future()
            return self._settled

    def drop(self, then: Callable[[], None]) -> bool:
        """On the loop, as the request releases its regions: True when it may (the worker has not
        begun writing, and now never will, or has finished); False while it writes, ``then``
        being called on the loop when it is done."""
        with self._lock:
            if self._state == _WRITING:
                self._then = then
                return False
            if self._state == _NEW:
                self._state = _DROPPED
                self._let_go()
            return True

    def _let_go(self) -> None:
        """No view of a client's mapping kept past the writes (an unregistration unmaps it once
        the last one is gone); what each target was stays, for the encoder's claims."""
        for target in self._targets:
            if target is not None:
                target.view = None
        self._bound = {}


def _set(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
