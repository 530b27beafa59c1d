"""Sealed memfd regions: client memory the daemon may map, because it cannot shrink.

A POSIX shared memory object is copied with preadv/pwrite (shm_io.py): its owner can truncate it
at any time, and a mapped page past the new end is SIGBUS, which kills the process. A memfd that
carries the F_SEAL_SHRINK seal cannot be truncated by anyone, ever (seals only ever grow), so a
mapping of it stays valid for its whole life: inputs are read and outputs written in place, with
no copy through the kernel. The client hands the descriptor over a Unix socket (SCM_RIGHTS,
fd_socket.py), so possession of the memory is the permission: the daemon opens nothing by name.

What a client can still do is change the bytes while the model reads them; that only garbles its
own answer (every parse of a mapped input is bounded by the region's size).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
from dataclasses import dataclass

from edged.errors import SharedMemoryError

# fcntl's constants exist on Linux from Python 3.8; spelled out for mypy on other platforms.
F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
F_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 0x0002)
F_SEAL_WRITE = getattr(fcntl, "F_SEAL_WRITE", 0x0008)
F_SEAL_FUTURE_WRITE = 0x0010  # Linux 5.1; not in fcntl's constants
SEALS_NEEDED = F_SEAL_SHRINK


@dataclass(frozen=True)
class Sealed:
    """A mapped sealed memfd: ``size`` bytes from offset 0; ``writable`` unless write-sealed."""

    mapping: mmap.mmap
    size: int
    writable: bool


def map_sealed(fd: int, offset: int, byte_size: int) -> Sealed:
    """Check that ``fd`` is a memfd sealed against shrinking and large enough for
    [offset, offset + byte_size), and map that much of it. Does not close ``fd``."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise SharedMemoryError("the descriptor is not a memfd (create it with memfd_create and MFD_ALLOW_SEALING)")
    try:
        seals = fcntl.fcntl(fd, F_GET_SEALS)
    except OSError:
        # EINVAL: a file that cannot carry seals (a regular file, a POSIX shm object).
        raise SharedMemoryError(
            "the descriptor is not a memfd that can be sealed (memfd_create with MFD_ALLOW_SEALING); "
            "register a POSIX shared memory object by its key instead"
        ) from None
    if not seals & SEALS_NEEDED:
        raise SharedMemoryError(
            "the memfd is not sealed against shrinking: add F_SEAL_SHRINK (fcntl F_ADD_SEALS) before registering it"
        )
    end = offset + byte_size
    if end > st.st_size:
        raise SharedMemoryError(f"offset {offset} + byte_size {byte_size} exceeds the memfd's {st.st_size} bytes")
    writable = not seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    try:
        mapping = mmap.mmap(fd, end, mmap.MAP_SHARED, prot)
    except OSError as e:
        raise SharedMemoryError(f"cannot map the memfd: {e.strerror}") from None
    return Sealed(mapping, end, writable)


# madvise advice that faults a range in without touching its bytes (Linux 5.14; Jetson Linux 36
# ships 5.15); older kernels answer EINVAL and the pages are touched one by one instead.
MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23


def populate(mapping: mmap.mmap, start: int, size: int, writable: bool) -> None:
    """Fault [start, start + size) of a mapping in now (at registration, on a worker thread), so
    that the first request that reads or writes it does not pay for it."""
    page = mmap.PAGESIZE
    first = start - start % page
    try:
        mapping.madvise(MADV_POPULATE_WRITE if writable else MADV_POPULATE_READ, first, start + size - first)
    except OSError:
        view = memoryview(mapping)
        try:
            for pos in range(first, start + size, page):
                view[pos]
        finally:
            view.release()


def unmap(mapping: mmap.mmap) -> bool:
    """Unmap now if no request still holds a view of it; False leaves it to the last view."""
    try:
        mapping.close()
    except BufferError:
        return False
    return True
