"""Inputs copied out of POSIX objects by the model's worker thread, right before its run.

Copied on a copier thread instead, a frame's request crosses two more thread hand-offs: the loop
wakes a copier, the copier wakes the loop, the loop wakes the model's worker. When the worker is
idle it is the next thread to touch the frame anyway, so it copies it there (preadv, as every copy
out of a POSIX object is made: a shrunk object is a short read, never SIGBUS) and the run reads
bytes still in its own core's cache. A worker that is busy leaves the copy to a copier thread,
which then overlaps the run ahead of it (copies.ShmRequest.read_on_worker decides).

A lock makes the worker's copies and the request's release exclusive: a request released before
its worker starts copying (cancelled, timed out, the model unloaded) is never copied, and one
released during the copies keeps its regions until they end, so a descriptor is never closed (and
its number reused) under a running copy.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence

import numpy as np

from edged.errors import ShuttingDownError
from edged.thread_to_loop import to_loop
from edged.transports.shm.regions import Region

# (region, position in its object, the daemon's buffer): one copy out of a region.
Job = tuple[Region, int, np.ndarray]
Reader = Callable[[Region, int, np.ndarray], None]

_NEW, _COPYING, _DONE, _DROPPED = range(4)


class WorkerReads:
    """The copies of one request's inputs, for the model's worker (serving.sinks.InputSource)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, jobs: Sequence[Job], read: Reader) -> None:
        self._loop = loop
        self._jobs = list(jobs)
        self._read = read
        self._lock = threading.Lock()
        self._state = _NEW
        self._then: Callable[[], None] | None = None

    @property
    def nbytes(self) -> int:
        return sum(buf.nbytes for _, _, buf in self._jobs)

    def fill(self) -> None:
        """On the worker thread, before the run: every input's bytes into its buffer. Raises the
        copy's error (a shrunk object is shared_memory_truncated), which fails the request."""
        with self._lock:
            if self._state != _NEW:
                # Released already: nobody waits for it, and its regions may be gone.
                raise ShuttingDownError("the request was released before its inputs were copied")
            self._state = _COPYING
        try:
            for job in self._jobs:
                self._read(*job)
        finally:
            with self._lock:
                self._state = _DONE
                then, self._then = self._then, None
                self._jobs.clear()  # no buffer kept past the copies
            if then is not None:
                to_loop(self._loop, then)

    def drop(self, then: Callable[[], None]) -> bool:
        """On the loop, as the request releases its regions: True when it may (the worker has not
        begun copying, and now never will, or has finished); False while it copies, ``then``
        being called on the loop when it is done."""
        with self._lock:
            if self._state == _COPYING:
                self._then = then
                return False
            if self._state == _NEW:
                self._state = _DROPPED
                self._jobs.clear()
            return True
