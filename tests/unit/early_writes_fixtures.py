"""Shared memory regions and helpers for the tests of outputs the model's worker writes into
shared memory: two real memfd regions (one written with the kernel's pwrite, one mapped), a
lookup of them by name, the bytes a region holds, and a thread standing for the model's worker.
Test modules import ``regions`` and the autouse ``memfd_create_available`` and list them in
``__all__``, since pytest finds fixtures in the test module."""

from __future__ import annotations

import asyncio
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from edged.errors import SharedMemoryNotFoundError
from edged.transports.shm.regions import Region
from edged.wire.tensors import OutputRequest
from tests.helpers import unavailable


@pytest.fixture(autouse=True)
def memfd_create_available() -> None:
    if not hasattr(os, "memfd_create"):
        unavailable("no memfd_create on this platform")


SIZE = 1 << 22


@pytest.fixture
def regions() -> Iterator[dict[str, Region]]:
    """``posix``: written with the kernel's pwrite; ``mapped``: a writable mapping, as a sealed memfd is."""
    made: dict[str, Region] = {}
    for name in ("posix", "mapped"):
        fd = os.memfd_create(f"edged-unit-{name}", os.MFD_CLOEXEC)
        os.ftruncate(fd, SIZE)
        region = Region(name, "memfd", 0, SIZE, fd, os.getuid(), os.getpid())
        if name == "mapped":
            region.mapping = mmap.mmap(fd, SIZE)
        made[name] = region
    yield made
    for region in made.values():
        if region.mapping is not None:
            region.mapping.close()
        if region.fd >= 0:
            os.close(region.fd)


def lookup(regions: dict[str, Region]) -> Callable[[str], Region]:
    def find(name: str) -> Region:
        if name not in regions:
            raise SharedMemoryNotFoundError(f"shared memory region '{name}' is not registered")
        return regions[name]

    return find


def contents(region: Region, offset: int, nbytes: int) -> bytes:
    return os.pread(region.fd, nbytes, offset)


def outputs(*specs: tuple[str, str, int, int]) -> list[OutputRequest]:
    return [OutputRequest(name, False, region, offset, size) for name, region, offset, size in specs]


def on_a_thread(fn: Callable[[], None]) -> str:
    names: list[str] = []

    def run() -> None:
        fn()
        names.append(threading.current_thread().name)

    t = threading.Thread(target=run, name="fake-model-worker")
    t.start()
    t.join(10)
    assert names, "the writer thread did not finish"
    return names[0]


async def until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.001)
