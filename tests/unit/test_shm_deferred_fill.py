"""A large shared-memory input copied by the model's worker thread just before the run
(edged.transports.shm_io.ShmRequest.deferred_fill, edged.scheduler's ``prepare``): the copy
happens there and nowhere else, a request abandoned first never copies, and one abandoned while
the copy runs keeps its region held until the copy is done (a descriptor is never closed, and its
number reused, under a running copy)."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator, Mapping

import numpy as np
import pytest

from edged.errors import SharedMemoryTruncatedError, ShuttingDownError
from edged.scheduler import ModelQueue
from edged.transports import shm_io
from edged.transports.shm import Region
from tests.unit.test_scheduler import FakeInstance

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="no memfd_create on this platform")

SIZE = shm_io.INLINE_COPY_BYTES * 2  # past the loop's limit: the worker copies


@pytest.fixture
def region() -> Iterator[Region]:
    fd = os.memfd_create("edged-test-deferred", os.MFD_CLOEXEC)
    os.pwrite(fd, np.arange(SIZE // 4, dtype=np.float32).tobytes(), 0)
    yield Region("frame", "memfd", 0, SIZE, fd, os.getuid(), os.getpid())
    os.close(fd)


class RecordingInstance(FakeInstance):
    """Remembers the first value it saw and on which thread it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[float, str]] = []

    def infer(self, inputs: Mapping[str, np.ndarray], checked: bool = False) -> dict[str, np.ndarray]:
        x = inputs["x"]
        self.seen.append((float(x.reshape(-1)[1]), threading.current_thread().name))
        return {"y": x[:1, :1] * 2}


def test_the_worker_copies_a_large_input_before_the_model_sees_it(region: Region) -> None:
    inst = RecordingInstance()
    copied_on: list[str] = []
    read_all = shm_io._read_all

    def where(region: Region, pos: int, buf: np.ndarray) -> None:
        copied_on.append(threading.current_thread().name)
        read_all(region, pos, buf)

    async def main() -> None:
        q = ModelQueue("m", [inst], asyncio.get_running_loop(), depth=4)
        q.start(inline=True, inline_max_elements=10**9)  # inline allowed: a prepared request is never inline
        req = shm_io.ShmRequest(lambda name: region, None)
        x = np.frombuffer(req.input("frame", 0, SIZE), np.float32).reshape(1, -1)
        prepare = req.deferred_fill()
        assert prepare is not None
        shm_io._read_all = where
        try:
            await q.submit({"x": x}, 10, prepare=prepare)
        finally:
            shm_io._read_all = read_all
        req.release()
        q.close()
        assert region.users == 0

    asyncio.run(main())
    assert inst.seen == [(1.0, inst.seen[0][1])] and inst.seen[0][1].startswith("edged-worker-")
    assert copied_on == [inst.seen[0][1]], "the copy did not run on the model's worker thread"


def test_small_inputs_are_copied_on_the_loop(region: Region) -> None:
    async def main() -> None:
        req = shm_io.ShmRequest(lambda name: region, None)
        req.input("frame", 0, 4096)
        assert req.deferred_fill() is None
        req.release()

    asyncio.run(main())


def test_a_request_abandoned_before_its_copy_never_copies(region: Region) -> None:
    async def main() -> None:
        req = shm_io.ShmRequest(lambda name: region, None)
        req.input("frame", 0, SIZE)
        prepare = req.deferred_fill()
        assert prepare is not None
        req.release()  # the caller timed out while the request waited in the queue
        assert region.users == 0
        with pytest.raises(ShuttingDownError, match="abandoned"):
            prepare()  # the worker took it afterwards: it must not touch the descriptor

    asyncio.run(main())


def test_a_request_abandoned_during_its_copy_holds_its_region_until_the_copy_ends(region: Region) -> None:
    started, go = threading.Event(), threading.Event()
    read_all = shm_io._read_all

    def slow(region: Region, pos: int, buf: np.ndarray) -> None:
        started.set()
        assert go.wait(10)
        read_all(region, pos, buf)

    async def main() -> None:
        req = shm_io.ShmRequest(lambda name: region, None)
        req.input("frame", 0, SIZE)
        prepare = req.deferred_fill()
        assert prepare is not None
        shm_io._read_all = slow
        try:
            copier = threading.Thread(target=prepare)
            copier.start()
            assert await asyncio.to_thread(started.wait, 10)
            req.release()  # the caller gave up while the worker copies
            assert region.users == 1, "released under a running copy"
            go.set()
            await asyncio.to_thread(copier.join, 10)
        finally:
            shm_io._read_all = read_all
        deadline = asyncio.get_running_loop().time() + 10
        while region.users and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)  # the release the copy hands back to the loop
        assert region.users == 0

    asyncio.run(main())


def test_a_failed_copy_fails_its_request_and_the_worker_serves_on(region: Region) -> None:
    inst = RecordingInstance()

    async def main() -> None:
        q = ModelQueue("m", [inst], asyncio.get_running_loop(), depth=4)
        q.start()
        req = shm_io.ShmRequest(lambda name: region, None)
        x = np.frombuffer(req.input("frame", 0, SIZE), np.float32).reshape(1, -1)
        prepare = req.deferred_fill()
        assert prepare is not None
        os.ftruncate(region.fd, 0)  # the client shrank its object after registering it
        with pytest.raises(SharedMemoryTruncatedError):
            await q.submit({"x": x}, 10, prepare=prepare)
        req.release()
        out = await q.submit({"x": np.ones((1, 2), np.float32)}, 10)
        assert out["y"].tolist() == [[2.0]]
        q.close()

    asyncio.run(main())
    assert len(inst.seen) == 1, "the model ran on inputs that were never copied"
