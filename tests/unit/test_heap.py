"""edged/host/malloc.py: large buffers stay faulted in between requests; the start-up's objects frozen."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from edged.host import malloc as heap
from tests.helpers import unavailable

# A 3 MB buffer made, touched and freed (the warm-up's), then made and touched again (the first
# request's): the faults of the second.
PROBE = """
import ctypes, resource, sys
from edged.host import malloc as heap
if sys.argv[1] != "untuned":
    assert heap.keep_large_buffers()
def touched(size=3 << 20):
    b = bytearray(size)
    b[::4096] = b"x" * len(range(0, size, 4096))
    return b
first = touched()  # the warm-up's buffer
del first
if sys.argv[1] in ("trimmed", "prefaulted"):
    # What the collection before READY=1 can do: free enough at once that glibc trims the heap.
    assert ctypes.CDLL(None).malloc_trim(0) == 1
if sys.argv[1] == "prefaulted":
    assert heap.prefault((3 << 20) + heap.PREFAULT_SLACK) > 0
size = 3 << 20
if sys.argv[1] == "prefaulted-at-the-cap":  # a 15 MiB body, the largest prefault
    size = 15 << 20
    first = touched(size)
    del first
    assert ctypes.CDLL(None).malloc_trim(0) == 1
    assert heap.prefault(64 << 20) == heap.PREFAULT_MAX
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
again = touched(size)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.fixture
def _glibc() -> None:
    if not sys.platform.startswith("linux"):
        unavailable("glibc's mallopt and malloc_trim: Linux only")


glibc = pytest.mark.usefixtures("_glibc")


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout)


@glibc
def test_a_frame_sized_buffer_made_again_costs_no_page_faults() -> None:
    untuned, tuned = faults("untuned"), faults("tuned")
    # 3 MB is 768 pages. Untuned, glibc mapped the first buffer and unmapped it when freed, then
    # raised its threshold: the second comes from a heap that has to grow, page by page.
    assert untuned > 500, f"the probe sees no faults even untuned ({untuned}): it measures nothing"
    assert tuned < 50, f"{tuned} faults making a 3 MB buffer again"


@glibc
def test_a_heap_trimmed_after_the_warm_up_is_faulted_in_again_by_prefault() -> None:
    trimmed, prefaulted = faults("trimmed"), faults("prefaulted")
    assert trimmed > 500, f"a trimmed heap costs no faults ({trimmed}): the probe measures nothing"
    assert prefaulted < 50, f"{prefaulted} faults making a 3 MB buffer after prefault"


@glibc
def test_the_largest_prefault_stays_in_the_heap() -> None:
    # Up to the trim threshold less glibc's top pad: a block of the threshold less a page goes
    # back to the kernel as soon as it is freed (3,810 faults on a 15 MiB buffer after it).
    assert faults("prefaulted-at-the-cap") < 100


def test_prefault_is_bounded_and_needs_the_tuned_heap() -> None:
    assert heap.prefault(0) == 0
    tuned = heap.keep_large_buffers()
    assert heap.prefault(64 << 20) == (heap.PREFAULT_MAX if tuned else 0)


def test_settle_freezes_what_the_start_up_left() -> None:
    try:
        heap.settle()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
