"""Copies between client shared memory and daemon buffers, for one request.

A sealed memfd region (memfd.py) needs no copy: its mapped bytes are handed out as they are.

The daemon never reads or writes client pages through a mapping (see shm.py): the kernel copies
with preadv/pwrite on the descriptor kept since registration, so a shrunk object is a short read
or a failed size check for that request, never SIGBUS. Small copies run on the loop, large ones
on a worker thread; a request cancelled while a thread copies keeps its regions held until the
thread is done, so a descriptor is never closed (and its number reused) under a running copy.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from edged.errors import EdgedError, SharedMemoryError, SharedMemoryTruncatedError
from edged.transports.peer import Peer
from edged.transports.shm.memfd import submit_populate
from edged.transports.shm.regions import Region
from edged.transports.shm.worker_reads import WorkerReads
from edged.transports.shm.worker_writes import EarlyWrites, Target
from edged.wire.tensors import OutputRequest

# Copies up to this size run on the loop: handing them to a thread costs more than the copy.
INLINE_COPY_BYTES = 256 * 1024
# Copier threads: a frame's copy is one piece on one thread. Splitting it across threads was
# measured (bench first-request, 16-core host, commit 9a1007b against one piece in the same run):
# no steady gain (3.73 vs 3.66 ms a conv640 frame) and a slower first request, each extra thread
# being one more wake-up. Four threads copy for four requests at once; more wait their turn.
COPIERS = 4

Job = tuple[Region, int, np.ndarray]

# The copier threads: their own small pool (not the loop's default executor, where a slow file
# hash or memory probe could hold a frame's copy up), one started at warm-up (``warm_copies``).
_copiers = ThreadPoolExecutor(max_workers=COPIERS, thread_name_prefix="edged-shm-copy")


class ShmRequest:
    """The shared memory of one request: inputs are copied into daemon buffers before the model
    runs (``fill``), outputs are encoded into daemon buffers and then written out (``flush``).
    ``release`` must run at the end (it closes descriptors of regions unregistered meanwhile)."""

    def __init__(self, lookup: Callable[[str], Region], peer: Peer | None) -> None:
        self._lookup = lookup
        self._peer = peer
        self.reads: list[Job] = []
        self.writes: list[Job] = []
        self._held: list[Region] = []
        self._busy: asyncio.Future[None] | None = None  # a thread still copying
        self.early: EarlyWrites | None = None  # outputs the model's worker writes (``write_early``)
        self.late: WorkerReads | None = None  # inputs the model's worker copies (``read_on_worker``)
        self._mapped_inputs: list[tuple[Region, int, int]] = []  # (region, position, bytes) read in place

    def _take(self, name: str, offset: int, size: int) -> Region:
        region = self._lookup(name)
        if offset + size > region.byte_size:
            raise SharedMemoryError(
                f"shared memory region '{name}' is too small: offset {offset} + {size} bytes "
                f"> its {region.byte_size} bytes"
            )
        return self._hold(region)

    def _hold(self, region: Region) -> Region:
        region.users += 1
        self._held.append(region)
        return region

    def input(self, name: str, offset: int, size: int) -> memoryview:
        """Resolver for decode_infer: the mapped bytes of a sealed memfd, else a daemon-owned
        buffer that ``fill`` loads."""
        region = self._take(name, offset, size)
        if region.mapping is not None:
            start = region.offset + offset
            self._mapped_inputs.append((region, start, size))
            # Read-only: nothing in the daemon may write a client's input back into its memory.
            return memoryview(region.mapping)[start : start + size].toreadonly()
        buf = np.empty(size, np.uint8)
        self.reads.append((region, region.offset + offset, buf))
        return buf.data

    def output(self, name: str, offset: int, size: int) -> memoryview | None:
        """Resolver for encode_infer: None for an output the model's worker has written
        (``write_early``), else the mapped bytes of a sealed memfd (written in place), else a
        daemon-owned buffer that ``flush`` writes out."""
        if self.early is not None and self.early.claim(name, offset, size, self._lookup):
            return None
        region = self._take(name, offset, size)
        if region.mapping is not None:
            if not region.writable:
                raise SharedMemoryError(
                    f"shared memory region '{name}' is sealed against writing: it can hold inputs only"
                )
            start = region.offset + offset
            return memoryview(region.mapping)[start : start + size]
        buf = np.empty(size, np.uint8)
        self.writes.append((region, region.offset + offset, buf))
        return buf.data

    def write_early(self, outputs: Sequence[OutputRequest]) -> EarlyWrites:
        """The writes of the outputs bound for shared memory, for the model's worker to make
        right after its run (``EarlyWrites.run``). Each destination is taken here, on the loop,
        for the size the request gave; one that cannot be (an unknown region, too small, sealed
        against writing) is left to the encoder, which says why as it always has."""
        targets: list[Target | None] = []
        taken: list[tuple[Region, int, int]] = []  # the mapped bytes of the outputs before this one
        for out in outputs:
            if out.shm_region is None:
                continue
            try:
                region = self._lookup(out.shm_region)
            except EdgedError:
                targets.append(None)
                continue
            if out.shm_offset + out.shm_size > region.byte_size or (region.mapping is not None and not region.writable):
                targets.append(None)
                continue
            self._hold(region)
            start = region.offset + out.shm_offset
            view = None if region.mapping is None else memoryview(region.mapping)[start : start + out.shm_size]
            # Never run into bytes the run reads: an input's, or another output's (which a later
            # kernel may read), wherever they are mapped.
            over = view is not None and _overlaps(region, start, out.shm_size, [*self._mapped_inputs, *taken])
            if view is not None:
                taken.append((region, start, out.shm_size))
            targets.append(Target(out.name, out.shm_region, out.shm_offset, out.shm_size, region, view, not over))
        self.early = EarlyWrites(asyncio.get_running_loop(), targets, _write_all)
        return self.early

    def read_on_worker(self) -> WorkerReads | None:
        """The copies of the inputs ``fill`` would make, handed to the model's worker to make
        right before its run (worker_reads.py), when they are large enough to leave the loop;
        None (``fill`` copies them) for small ones, which the loop copies for less than a
        hand-off costs. ``fill`` then has nothing left to copy."""
        if not self.reads or sum(buf.nbytes for _, _, buf in self.reads) <= INLINE_COPY_BYTES:
            return None
        self.late = WorkerReads(asyncio.get_running_loop(), self.reads, _read_all)
        self.reads = []
        return self.late

    async def fill(self) -> None:
        await self._run(self.reads, _read_all)

    async def flush(self) -> None:
        await self._run(self.writes, _write_all)

    async def _run(self, jobs: list[Job], fn: Callable[[Region, int, np.ndarray], None]) -> None:
        if not jobs:
            return
        if sum(buf.nbytes for _, _, buf in jobs) <= INLINE_COPY_BYTES:
            for job in jobs:
                fn(*job)
            return

        def all_jobs() -> None:
            for job in jobs:
                fn(*job)

        self._busy = asyncio.get_running_loop().run_in_executor(_copiers, all_jobs)
        await asyncio.shield(self._busy)  # cancelled: the thread still runs; release() waits for it
        self._busy = None

    def release(self) -> None:
        if self._busy is not None and not self._busy.done():
            self._busy.add_done_callback(self._release_later)
            return
        if self.late is not None:
            if not self.late.drop(self.release):  # the worker is copying: released when it is done
                return
            self.late = None
        if self.early is not None:
            if not self.early.drop(self.release):  # the worker is writing: released when it is done
                return
            self.early = None
        for region in self._held:
            region.users -= 1
            region.close_if_idle()
        self._held.clear()

    def _release_later(self, fut: asyncio.Future[None]) -> None:
        if not fut.cancelled():
            fut.exception()  # retrieved: the request that wanted it is gone
        self._busy = None
        self.release()


def _overlaps(region: Region, start: int, size: int, others: list[tuple[Region, int, int]]) -> bool:
    """Whether bytes of this region's object overlap any of ``others`` (region, position, bytes):
    one registered under two names is mapped twice, at two addresses (``Region.file``)."""
    return any(
        (other is region or other.file == region.file) and at < start + size and start < at + n
        for other, at, n in others
    )


def _read_all(region: Region, pos: int, buf: np.ndarray) -> None:
    view = buf.data
    done = 0
    while done < len(view):
        try:
            n = os.preadv(region.fd, [view[done:]], pos + done)
        except OSError as e:
            raise SharedMemoryError(f"shared memory region '{region.name}' cannot be read: {e.strerror}") from None
        if n == 0:
            raise SharedMemoryTruncatedError(
                f"shared memory region '{region.name}': its object '{region.key}' was shrunk to "
                f"{pos + done} bytes after registration; register it again"
            )
        done += n


def _write_all(region: Region, pos: int, buf: np.ndarray) -> None:
    end = pos + buf.nbytes
    size = os.fstat(region.fd).st_size
    if size < end:
        # pwrite past the end would grow the client's object instead of failing.
        raise SharedMemoryTruncatedError(
            f"shared memory region '{region.name}': its object '{region.key}' was shrunk to {size} "
            f"bytes after registration; register it again"
        )
    view = buf.data
    done = 0
    while done < len(view):
        try:
            done += os.pwrite(region.fd, view[done:], pos + done)
        except OSError as e:
            raise SharedMemoryError(f"shared memory region '{region.name}' cannot be written: {e.strerror}") from None


def populate_region(region: Region, then: Callable[[BaseException | None], None]) -> None:
    """Fault a mapped region's pages in on the populating thread (the daemon's first touch of a
    client's frame costs about a fault per 64 KiB), then call ``then`` on the loop with the error,
    if any. Only a region whose pages the client has allocated (memfd.Sealed.allocated): faulting
    in holes would allocate them, charged to the daemon. The region is held meanwhile, as by a
    request, so it is never unmapped under the thread."""
    assert region.mapping is not None
    if not region.allocated:
        then(None)
        return
    region.users += 1
    fut = asyncio.wrap_future(submit_populate(region.mapping, region.offset, region.byte_size, region.writable))

    def finished(f: asyncio.Future[None]) -> None:
        region.users -= 1
        region.close_if_idle()
        then(None if f.cancelled() else f.exception())

    fut.add_done_callback(finished)


async def warm_copies(nbytes: int) -> None:
    """Run the copy path once both ways against a daemon-owned memfd of ``nbytes`` (before
    READY=1): starts a copier thread and runs the code a client's first frame takes, so that
    frame pays for none of it."""
    if not hasattr(os, "memfd_create"):
        return
    nbytes = max(nbytes, INLINE_COPY_BYTES + 1)  # large enough to take the thread path
    fd = os.memfd_create("edged-warm-copy", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        region = Region("edged-warm-up", "memfd", 0, nbytes, fd, os.getuid(), os.getpid())
        req = ShmRequest(lambda name: region, None)
        req.input(region.name, 0, nbytes)
        await req.fill()
        req.output(region.name, 0, nbytes)
        await req.flush()
        req.release()
    finally:
        os.close(fd)
