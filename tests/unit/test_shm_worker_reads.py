"""Inputs in a POSIX-style object (a memfd read with preadv, never mapped) copied by the model's
worker right before its run (edged.transports.shm.worker_reads): on that thread, the copy's error
failing the request alone, and a request released before or during the copy never leaving a
descriptor closed under it. The model is a fake instance (the scheduler's logic); the copies are
real preadv calls on a real descriptor."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator, Mapping

import numpy as np
import pytest

from edged.backends.base import Instance
from edged.errors import SharedMemoryTruncatedError
from edged.serving.scheduler import WORKER_THREAD_PREFIX, ModelQueue
from edged.transports.shm import copies as shm_io
from tests.helpers import unavailable

N = 1 << 20  # past INLINE_COPY_BYTES: a copy that leaves the loop


class FakeInstance(Instance):
    """Doubles its input; can be held by a gate."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()

    def infer(self, inputs: Mapping[str, np.ndarray], checked: bool = False) -> dict[str, np.ndarray]:
        return self._infer_impl(inputs)

    def _infer_impl(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        assert self.gate.wait(30)
        return {"y": inputs["x"] * 2}


@pytest.fixture
def region() -> Iterator[shm_io.Region]:
    if not hasattr(os, "memfd_create"):
        unavailable("no memfd_create on this platform")
    fd = os.memfd_create("edged-test-reads", os.MFD_CLOEXEC)
    os.ftruncate(fd, N)
    os.pwrite(fd, np.arange(N // 4, dtype=np.float32).tobytes(), 0)
    reg = shm_io.Region("in", "memfd", 0, N, fd, os.getuid(), os.getpid())
    yield reg
    os.close(fd)


def _request(reg: shm_io.Region) -> tuple[shm_io.ShmRequest, dict[str, np.ndarray]]:
    req = shm_io.ShmRequest(lambda name: reg, None)
    x = np.frombuffer(req.input("in", 0, N), np.float32).reshape(1, N // 4)
    return req, {"x": x}


def test_an_idle_workers_request_is_copied_on_that_worker(region: shm_io.Region) -> None:
    seen: list[str] = []
    read_all = shm_io._read_all

    def where(region: shm_io.Region, pos: int, buf: np.ndarray) -> None:
        read_all(region, pos, buf)
        seen.append(threading.current_thread().name)

    async def main() -> np.ndarray:
        q = ModelQueue("m", [FakeInstance()], asyncio.get_running_loop(), depth=4)
        q.start()
        assert q.idle
        req, inputs = _request(region)
        source = req.read_on_worker()
        assert source is not None and source.nbytes == N
        await req.fill()  # nothing left for the loop or a copier to copy
        assert seen == []
        try:
            return (await q.submit(inputs, 10, source=source))["y"]
        finally:
            req.release()
            q.close()

    shm_io._read_all = where
    try:
        y = asyncio.run(main())
    finally:
        shm_io._read_all = read_all
    assert len(seen) == 1 and seen[0].startswith(WORKER_THREAD_PREFIX), seen
    assert np.array_equal(y.ravel(), np.arange(N // 4, dtype=np.float32) * 2)
    assert region.users == 0


def test_a_shrunk_object_fails_that_request_on_the_worker(region: shm_io.Region) -> None:
    async def main() -> None:
        q = ModelQueue("m", [FakeInstance()], asyncio.get_running_loop(), depth=4)
        q.start()
        req, inputs = _request(region)
        source = req.read_on_worker()
        os.ftruncate(region.fd, N // 2)  # what any client may do to its own object
        try:
            with pytest.raises(SharedMemoryTruncatedError, match="shrunk"):
                await q.submit(inputs, 10, source=source)
            os.ftruncate(region.fd, N)
            again, more = _request(region)
            assert (await q.submit(more, 10, source=again.read_on_worker()))["y"].shape == (1, N // 4)
            again.release()
        finally:
            req.release()
            q.close()

    asyncio.run(main())
    assert region.users == 0


def test_a_request_released_before_its_copy_is_never_copied(region: shm_io.Region) -> None:
    copied: list[int] = []
    read_all = shm_io._read_all

    def counting(region: shm_io.Region, pos: int, buf: np.ndarray) -> None:
        read_all(region, pos, buf)
        copied.append(buf.nbytes)

    async def main() -> None:
        inst = FakeInstance()
        q = ModelQueue("m", [inst], asyncio.get_running_loop(), depth=4)
        q.start()
        inst.gate.clear()  # the worker busy with a first request
        first = asyncio.ensure_future(q.submit({"x": np.ones((1, 4), np.float32)}, 10))
        while q.idle:
            await asyncio.sleep(0)
        req, inputs = _request(region)
        source = req.read_on_worker()
        second = asyncio.ensure_future(q.submit(inputs, 10, source=source))
        await asyncio.sleep(0)
        second.cancel()  # the client went away while it queued
        with pytest.raises(asyncio.CancelledError):
            await second
        req.release()
        assert region.users == 0  # released at once: no copy was under way
        inst.gate.set()
        await first
        q.close()

    shm_io._read_all = counting
    try:
        asyncio.run(main())
    finally:
        shm_io._read_all = read_all
    assert copied == []


def test_a_request_released_during_its_copy_keeps_its_region_until_the_copy_ends(region: shm_io.Region) -> None:
    copying, go_on = threading.Event(), threading.Event()
    read_all = shm_io._read_all

    def slow(region: shm_io.Region, pos: int, buf: np.ndarray) -> None:
        copying.set()
        assert go_on.wait(30)
        read_all(region, pos, buf)

    async def main() -> None:
        q = ModelQueue("m", [FakeInstance()], asyncio.get_running_loop(), depth=4, max_batch=1)
        q.start()
        req, inputs = _request(region)
        task = asyncio.ensure_future(q.submit(inputs, 10, source=req.read_on_worker()))
        while not copying.is_set():
            await asyncio.sleep(0.001)  # polling a thread's event, bounded by the test's timeout
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        req.release()
        assert region.users == 1, "released under a running copy"
        go_on.set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while region.users and loop.time() < deadline:
            await asyncio.sleep(0.001)
        assert region.users == 0, "never released once the copy ended"
        q.close()

    shm_io._read_all = slow
    try:
        asyncio.run(main())
    finally:
        shm_io._read_all = read_all


def test_a_small_input_is_left_to_the_loop(region: shm_io.Region) -> None:
    async def main() -> None:
        req = shm_io.ShmRequest(lambda name: region, None)
        req.input("in", 0, shm_io.INLINE_COPY_BYTES)
        assert req.read_on_worker() is None
        await req.fill()
        req.release()

    asyncio.run(main())
