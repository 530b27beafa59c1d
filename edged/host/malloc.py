"""The daemon's heap, set up so that the first request after READY=1 costs what later ones do.

- glibc serves an allocation above its mmap threshold (128 KiB at first) with a fresh mmap, and
  returns it to the kernel when freed: every frame-sized buffer (a request body, an input or
  output tensor) is then page-faulted in again, about 950 faults (2-3 ms on a small board) for
  a 3 MB body. glibc raises the threshold after the first such free, so the *first* request of
  each size paid them and later ones did not. A fixed threshold of 32 MiB (glibc's largest) and a
  trim threshold of 16 MiB keep such buffers in the heap, already faulted in by the warm-up, at
  the price of up to 16 MiB of freed heap per arena kept (not returned) between requests.
  Measured (3 models, two frames through shared memory, 2-core machine): resident memory after
  serving 178 MiB, as with glibc's defaults; 191 MiB with a 64 MiB trim threshold.
- The collection below frees the start-up's garbage at once; when that leaves more than the trim
  threshold free at the top of the heap, glibc returns all of it to the kernel but 128 KiB
  (M_TOP_PAD), the frame-sized buffers the warm-up had faulted in with it. Under systemd the
  first request's 3 MiB body then paid 821 page faults (2-3 ms on the 2-core machine) in 7
  starts of 8. So once the collection is done, the largest body the warm-up sent, plus
  PREFAULT_SLACK for what a request allocates beside it (the socket's read buffers, the header,
  the answer), is allocated again, touched and freed: it stays at the top of the heap, faulted
  in, for the first request (up to the trim threshold: more would be trimmed as soon as it is
  freed). With the body alone the first request still paid 215 faults.
- The warm-up leaves the objects of a whole start-up (modules, sessions, the warm-up's own
  requests) for the cyclic garbage collector's oldest generation, whose next full pass would
  land on an early request. They are collected once and frozen before READY=1: later passes
  skip them.

Both apply to glibc and CPython only; elsewhere they do nothing.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import platform
from functools import cache

log = logging.getLogger(__name__)

# mallopt(3) parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# glibc's DEFAULT_MMAP_THRESHOLD_MAX: 32 MiB on 64-bit, 16 MiB on 32-bit (a larger value is refused).
MMAP_THRESHOLD = 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long)
TRIM_THRESHOLD = 16 * 1024 * 1024
_PAGE = 4096
# glibc's DEFAULT_TOP_PAD: kept at the top of the heap beside a freed block, so a block larger than
# the trim threshold less this is given back to the kernel as soon as it is freed.
_TOP_PAD = 128 * 1024
PREFAULT_MAX = TRIM_THRESHOLD - _TOP_PAD - _PAGE
PREFAULT_SLACK = 1024 * 1024

_kept = False  # keep_large_buffers applied: without it a large block is mapped, not in the heap


@cache
def _glibc() -> ctypes.CDLL | None:
    """The process's own C library (no ldconfig lookup), or None where it is not glibc."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def keep_large_buffers() -> bool:
    """Fix glibc's mmap and trim thresholds (see the module's docstring); False where not glibc."""
    global _kept
    libc = _glibc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt answers 1 on success, 0 for a value it refuses; each is set whatever the other did.
    refused = [name for name, param, value in _SETTINGS if mallopt(param, value) != 1]
    if refused:
        log.warning("glibc refused %s; a first large request may pay page faults", ", ".join(refused))
    _kept = not refused
    return _kept


_SETTINGS = (
    ("M_MMAP_THRESHOLD", M_MMAP_THRESHOLD, MMAP_THRESHOLD),
    ("M_TRIM_THRESHOLD", M_TRIM_THRESHOLD, TRIM_THRESHOLD),
)


def settle(largest_body: int = 0) -> int:
    """Collect and freeze what the start-up left, then fault in ``largest_body`` bytes at the top
    of the heap (before READY=1). Returns the bytes faulted in (0 where not glibc)."""
    gc.collect()
    gc.freeze()
    return prefault(largest_body + PREFAULT_SLACK if largest_body else 0)


def prefault(nbytes: int) -> int:
    """Allocate ``nbytes`` (at most PREFAULT_MAX) with this thread's malloc, write every page and
    free it: the pages stay in the heap for the next allocation of that size. Returns the bytes
    touched; 0 where keep_large_buffers did not apply (not glibc, or refused)."""
    nbytes = min(nbytes, PREFAULT_MAX)
    libc = _glibc()
    if nbytes <= 0 or not _kept or libc is None:
        return 0
    malloc, free = libc.malloc, libc.free
    malloc.argtypes, malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    free.argtypes, free.restype = [ctypes.c_void_p], None
    block = malloc(nbytes)
    if not block:
        return 0
    try:
        ctypes.memset(block, 1, nbytes)  # not 0: a fresh page may be mapped without touching it
    finally:
        free(block)
    return nbytes


def trim() -> bool:
    """Give the free memory of every arena back to the kernel (glibc's malloc_trim): after a
    large body was inflated in steps on a worker thread, its freed steps would otherwise stay
    resident in that thread's arena. False where not glibc."""
    libc = _glibc()
    malloc_trim = getattr(libc, "malloc_trim", None)
    if malloc_trim is None:
        return False
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    malloc_trim(0)
    return True


def thaw() -> None:
    """Give the frozen start-up objects back to the collector: a model unloaded or replaced may
    be held in a reference cycle among them (its backend, its sessions), which only the
    collector frees."""
    gc.unfreeze()
