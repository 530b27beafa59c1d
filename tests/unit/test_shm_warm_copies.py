"""The start-up warm-up of the shared-memory copy path (edged.transports.shm.copies.warm_copies): it
runs a real copy in and out through a daemon-owned memfd, leaves a copier thread started, and
leaves no descriptor behind."""

from __future__ import annotations

import asyncio
import os
import threading

import numpy as np

from edged.transports.shm import copies as shm_io
from tests.helpers import unavailable


def test_warm_copies_runs_the_copy_path_and_leaves_no_descriptor() -> None:
    if not hasattr(os, "memfd_create"):
        unavailable("no memfd_create on this platform")
    before = set(os.listdir("/proc/self/fd"))
    copied: list[int] = []
    read_all = shm_io._read_all

    def counting(region: shm_io.Region, pos: int, buf: np.ndarray) -> None:
        read_all(region, pos, buf)
        copied.append(buf.nbytes)

    shm_io._read_all = counting  # the real copy, counted
    try:
        asyncio.run(shm_io.warm_copies(1 << 20))
    finally:
        shm_io._read_all = read_all
    assert copied == [1 << 20], "the warm-up did not copy a frame-sized input out of its memfd"
    assert any(t.name.startswith("edged-shm-copy") for t in threading.enumerate()), "no copier thread started"
    assert set(os.listdir("/proc/self/fd")) <= before, "the warm-up left a descriptor open"


def test_warm_copies_takes_the_thread_path_even_for_a_small_model() -> None:
    # A model with tiny inputs still gets its frames' copy path warmed: the size is raised past
    # the inline limit, so the copier thread (not the loop) runs it.
    seen: list[str] = []
    read_all = shm_io._read_all

    def where(region: shm_io.Region, pos: int, buf: np.ndarray) -> None:
        read_all(region, pos, buf)
        seen.append(threading.current_thread().name)

    shm_io._read_all = where
    try:
        asyncio.run(shm_io.warm_copies(64))
    finally:
        shm_io._read_all = read_all
    assert len(seen) == 1 and seen[0].startswith("edged-shm-copy"), seen
