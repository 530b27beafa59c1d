"""The daemon's heap, set up so that the first request after READY=1 costs what later ones do.

- glibc serves an allocation above its mmap threshold (128 KiB at first) with a fresh mmap, and
  returns it to the kernel when freed: every frame-sized buffer (a request body, an input or
  output tensor) is then page-faulted in again, about 950 faults (2-3 ms on a small board) for
  a 3 MB body. glibc raises the threshold after the first such free, so the *first* request of
  each size paid them and later ones did not. A fixed threshold of 32 MiB (glibc's largest) and a
  trim threshold of 16 MiB keep such buffers in the heap, already faulted in by the warm-up, at
  the price of up to 16 MiB of freed heap per arena kept (not returned) between requests.
  Measured (3 models, two frames through shared memory, 2-core machine): resident memory after
  serving 178 MiB as before the change; 191 MiB with a 64 MiB trim threshold.
- The warm-up leaves the objects of a whole start-up (modules, sessions, the warm-up's own
  requests) for the cyclic garbage collector's oldest generation, whose next full pass would
  land on an early request. They are collected once and frozen before READY=1: later passes
  skip them.

Both apply to glibc and CPython only; elsewhere they do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging

log = logging.getLogger(__name__)

# mallopt(3) parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
TRIM_THRESHOLD = 16 * 1024 * 1024


def keep_large_buffers() -> bool:
    """Fix glibc's mmap and trim thresholds (see the module's docstring); False where not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt answers 1 on success, 0 for a value it refuses.
    done = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not done:
        log.warning("glibc refused the malloc thresholds; the first large request may pay page faults")
    return done


def settle() -> None:
    """Collect and freeze what the start-up left (before READY=1)."""
    gc.collect()
    gc.freeze()
