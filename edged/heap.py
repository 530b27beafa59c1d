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
import gc
import logging
import platform

log = logging.getLogger(__name__)

# mallopt(3) parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# glibc's DEFAULT_MMAP_THRESHOLD_MAX: 32 MiB on 64-bit, 16 MiB on 32-bit (a larger value is refused).
MMAP_THRESHOLD = 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long)
TRIM_THRESHOLD = 16 * 1024 * 1024


def keep_large_buffers() -> bool:
    """Fix glibc's mmap and trim thresholds (see the module's docstring); False where not glibc."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library: no ldconfig lookup
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt answers 1 on success, 0 for a value it refuses; each is set whatever the other did.
    refused = [name for name, param, value in _SETTINGS if mallopt(param, value) != 1]
    if refused:
        log.warning("glibc refused %s; a first large request may pay page faults", ", ".join(refused))
    return not refused


_SETTINGS = (
    ("M_MMAP_THRESHOLD", M_MMAP_THRESHOLD, MMAP_THRESHOLD),
    ("M_TRIM_THRESHOLD", M_TRIM_THRESHOLD, TRIM_THRESHOLD),
)


def settle() -> None:
    """Collect and freeze what the start-up left (before READY=1)."""
    gc.collect()
    gc.freeze()


def thaw() -> None:
    """Give the frozen start-up objects back to the collector: a model unloaded or replaced may
    be held in a reference cycle among them (its backend, its sessions), which only the
    collector frees."""
    gc.unfreeze()
