"""Sealed memfd regions: client memory the daemon may map, because it cannot shrink.

A POSIX shared memory object is copied with preadv/pwrite (copies.py): its owner can truncate it
at any time, and a mapped page past the new end is SIGBUS, which kills the process. A memfd that
carries the F_SEAL_SHRINK seal cannot be truncated by anyone, ever (seals only ever grow), so a
mapping of it stays valid for its whole life: inputs are read and outputs written in place, with
no copy through the kernel. The client hands the descriptor over a Unix socket (SCM_RIGHTS,
memfd_socket.py), so possession of the memory is the permission: the daemon opens nothing by name.

What a client hands over is untrusted, so, in this order:
- ``sealable`` asks for the seals first: F_GET_SEALS answers at once for any descriptor and
  touches no file system (a FUSE file or a hung NFS mount could block an fstat or a close forever;
  such descriptors are closed on a thread of their own, memfd_socket.py);
- only a memfd on the daemon's own shmem device is mapped: a hugetlbfs memfd takes the seal too,
  but a hole punched in it gives its huge pages back and the next access is SIGBUS;
- the pages are faulted in (``populate``, a thread, without the interpreter's lock) only where
  the client has allocated them already, so the memory is charged to the client, not the daemon;
- the last unmap (which frees a region's pages when the client has let go of them) runs on a
  thread too (``unmap_later``).

A client can still change the bytes while the model reads them; that only garbles its own answer
(every parse of a mapped input is bounded by the region's size).
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import stat
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from edged.errors import SharedMemoryError

# fcntl's constants exist on Linux from Python 3.8; spelled out for mypy on other platforms.
F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
F_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 0x0002)
F_SEAL_WRITE = getattr(fcntl, "F_SEAL_WRITE", 0x0008)
F_SEAL_FUTURE_WRITE = 0x0010  # Linux 5.1; not in fcntl's constants
SEALS_NEEDED = F_SEAL_SHRINK
# madvise advice that faults a range in without touching its bytes (Linux 5.14; Jetson Linux 36
# ships 5.15); older kernels answer EINVAL and the pages are touched instead.
MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23
_TOUCH_CHUNK = 1 << 20  # the fallback touches this much, then lets other threads run
_UNMAP_RETRY_S = 0.05  # a view still alive: try the unmap again this much later
_UNMAP_GIVE_UP_S = 60.0  # a view kept longer than any request: left to the garbage collector

# Threads of their own: a populate or an unmap of a large region must not wait behind, or hold
# up, the copies of other clients' frames (copies.py).
_populator = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edged-shm-populate")
_unmapper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edged-shm-unmap")


@dataclass(frozen=True)
class Sealed:
    """A mapped sealed memfd: ``size`` bytes from offset 0; ``writable`` unless write-sealed;
    ``allocated`` when the client has allocated every page of the region (fallocate or writes);
    ``file``: the object's (device, inode)."""

    mapping: mmap.mmap
    size: int
    writable: bool
    allocated: bool
    file: tuple[int, int]


def sealable(fd: int) -> int | None:
    """The descriptor's seals, or None for anything that cannot carry them. Never blocks."""
    try:
        return int(fcntl.fcntl(fd, F_GET_SEALS))
    except OSError:  # EINVAL: not shmem (a file, a socket, a pipe, a POSIX object)
        return None


@cache
def _shmem_device() -> int:
    """The device of an ordinary memfd (the kernel's internal shmem mount), made once."""
    fd = os.memfd_create("edged-shmem-probe", os.MFD_CLOEXEC)
    try:
        return os.fstat(fd).st_dev
    finally:
        os.close(fd)


def map_sealed(fd: int, seals: int, offset: int, byte_size: int) -> Sealed:
    """Check that ``fd`` (whose ``seals`` ``sealable`` returned) is an ordinary memfd sealed
    against shrinking and large enough for [offset, offset + byte_size), and map that much of it.
    Does not close ``fd``."""
    if not seals & SEALS_NEEDED:
        raise SharedMemoryError(
            "the memfd is not sealed against shrinking: add F_SEAL_SHRINK (fcntl F_ADD_SEALS) before registering it"
        )
    st = os.fstat(fd)  # shmem: answered from memory
    if not stat.S_ISREG(st.st_mode) or st.st_dev != _shmem_device():
        raise SharedMemoryError("only an ordinary memfd can be registered (not hugetlbfs: its holes can SIGBUS)")
    end = offset + byte_size
    if end > st.st_size:
        raise SharedMemoryError(f"offset {offset} + byte_size {byte_size} exceeds the memfd's {st.st_size} bytes")
    writable = not seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    try:
        mapping = mmap.mmap(fd, end, mmap.MAP_SHARED, prot)
    except OSError as e:
        raise SharedMemoryError(f"cannot map the memfd: {e.strerror}") from None
    return Sealed(mapping, end, writable, st.st_blocks * 512 >= end, (st.st_dev, st.st_ino))


@cache
def _madvise() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def populate(mapping: mmap.mmap, start: int, size: int, writable: bool) -> None:
    """Fault [start, start + size) of a mapping in now, on a worker thread: madvise through ctypes,
    which lets go of the interpreter's lock for the call (mmap.madvise holds it, and a 256 MiB
    populate then stalls the event loop for a quarter of a second)."""
    page = mmap.PAGESIZE
    first = start - start % page
    address = mapping_address(mapping)
    madvise = _madvise()
    advice = MADV_POPULATE_WRITE if writable else MADV_POPULATE_READ
    if madvise is not None and madvise(address + first, start + size - first, advice) == 0:
        return
    view = memoryview(mapping)  # an older kernel: touch a page in each, a chunk at a time
    try:
        for chunk in range(first, start + size, _TOUCH_CHUNK):
            for pos in range(chunk, min(chunk + _TOUCH_CHUNK, start + size), page):
                view[pos]
            time.sleep(0)  # let the event loop's thread have the interpreter's lock
    finally:
        view.release()


def mapping_address(mapping: mmap.mmap) -> int:
    """Where ``mapping`` starts in memory. Through numpy, which takes a read-only buffer too:
    ctypes' from_buffer refuses the mapping of a write-sealed memfd (and populating every such
    region failed with a TypeError)."""
    view = np.frombuffer(mapping, dtype=np.uint8, count=1)
    try:
        return int(view.ctypes.data)
    finally:
        del view  # no export of the mapping left behind: it must stay closable


def submit_populate(mapping: mmap.mmap, start: int, size: int, writable: bool) -> Future[None]:
    """``populate`` on the populating thread."""
    return _populator.submit(populate, mapping, start, size, writable)


def unmap_later(mapping: mmap.mmap) -> None:
    """Unmap on a thread: the last unmap of a region frees its pages (tens of ms for hundreds of
    MiB). A request's view still alive: tried again until it is gone, so the last reference is
    never dropped on the event loop."""
    _unmapper.submit(_unmap_when_free, mapping)


def _unmap_when_free(mapping: mmap.mmap) -> None:
    deadline = time.monotonic() + _UNMAP_GIVE_UP_S
    while not unmap(mapping) and time.monotonic() < deadline:
        time.sleep(_UNMAP_RETRY_S)


def unmap(mapping: mmap.mmap) -> bool:
    """Unmap now if no request still holds a view of it."""
    try:
        mapping.close()
    except BufferError:
        return False
    return True
