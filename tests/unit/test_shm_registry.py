"""The shared memory registry and per-request copies, with real /dev/shm objects and real pidfds
(no daemon): ownership, limits, truncation, and a request cancelled while a thread copies."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from edged.errors import (
    SharedMemoryLimitError,
    SharedMemoryNotFoundError,
    SharedMemoryTruncatedError,
)
from edged.transports.peer import Peer
from edged.transports.shm import copies as shm_io
from edged.transports.shm.copies import INLINE_COPY_BYTES, ShmRequest
from edged.transports.shm.regions import SharedMemoryRegistry, ShmLimits


@pytest.fixture
def key() -> Iterator[str]:
    name = f"edgedu-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4 << 20)
    os.pwrite(fd, bytes(range(256)) * 16, 0)
    os.close(fd)
    yield name
    os.unlink(f"/dev/shm/{name}")


def me() -> Peer:
    return Peer(os.getpid(), os.getuid(), os.getgid(), os.pidfd_open(os.getpid()))


def test_names_are_per_process_and_unknown_unregister_succeeds(key: str) -> None:
    async def main() -> None:
        reg = SharedMemoryRegistry()
        a, b = me(), Peer(os.getpid() + 1_000_000, os.getuid() + 1, 1, None)  # another (made-up) owner
        reg.register(a, "in", key, 0, 4096)
        assert [r["name"] for r in reg.status_for(a)] == ["in"]
        with pytest.raises(SharedMemoryNotFoundError):
            reg.status_for(b, "in")
        reg.unregister_for(b, "in")  # not b's: success, and nothing happens
        reg.unregister_for(a, "never-registered")
        assert reg.count() == 1
        reg.unregister()
        assert reg.count() == 0

    asyncio.run(main())


def test_truncated_object_is_an_error_for_the_request(key: str) -> None:
    async def main() -> None:
        reg = SharedMemoryRegistry()
        peer = me()
        reg.register(peer, "in", key, 0, 4096)
        req = ShmRequest(reg.region_for(peer), peer)
        view = req.input("in", 0, 256)
        await req.fill()
        assert bytes(view) == bytes(range(256))
        req.release()
        os.truncate(f"/dev/shm/{key}", 100)
        req = ShmRequest(reg.region_for(peer), peer)
        req.input("in", 0, 256)
        with pytest.raises(SharedMemoryTruncatedError, match="shrunk to 100 bytes"):
            await req.fill()
        req.release()
        reg.unregister()

    asyncio.run(main())


def test_per_peer_limit(key: str) -> None:
    async def main() -> None:
        reg = SharedMemoryRegistry(ShmLimits(max_regions=10, max_regions_per_peer=2))
        peer = me()
        reg.register(peer, "a", key, 0, 16)
        reg.register(peer, "b", key, 0, 16)
        with pytest.raises(SharedMemoryLimitError, match="max_regions_per_peer"):
            reg.register(peer, "c", key, 0, 16)
        reg.unregister()

    asyncio.run(main())


def test_region_bytes_are_bounded_in_total_and_per_user(key: str) -> None:
    async def main() -> None:
        limits = ShmLimits(max_region_bytes=1024, max_region_bytes_per_peer=512)
        reg = SharedMemoryRegistry(limits)
        peer = me()
        reg.register(peer, "a", key, 0, 256)
        reg.register(peer, "b", key, 0, 256)
        with pytest.raises(SharedMemoryLimitError, match="max_region_bytes_per_peer"):
            reg.register(peer, "c", key, 0, 1)
        reg.unregister_for(peer, "a")  # what an unregistration gives back is usable again
        reg.register(peer, "c", key, 0, 256)
        reg.unregister()

    asyncio.run(main())


class GatedExecutor(ThreadPoolExecutor):
    """A real thread pool whose jobs wait for ``gate``: the copy is provably still running."""

    def __init__(self) -> None:
        super().__init__(1)
        self.gate = threading.Event()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        def gated() -> Any:
            self.gate.wait(30)
            return fn(*args, **kwargs)

        return super().submit(gated)


def test_cancelled_copy_keeps_the_descriptor_until_the_thread_is_done(
    key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = GatedExecutor()
    # The copies run on shm_io's own pool (not the loop's default executor): gate that one, or
    # the copy may finish before the assertions below and the test checks nothing.
    monkeypatch.setattr(shm_io, "_copiers", pool)

    async def main() -> None:
        reg = SharedMemoryRegistry()
        peer = me()
        reg.register(peer, "in", key, 0, 4 << 20)
        region = reg.region_for(peer)("in")
        req = ShmRequest(reg.region_for(peer), peer)
        req.input("in", 0, 4 << 20)
        assert INLINE_COPY_BYTES < 4 << 20  # goes to a thread
        task = asyncio.ensure_future(req.fill())
        await asyncio.sleep(0)  # let the task hand the copy to the (gated) thread
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        req.release()
        reg.unregister()  # unregistered while the thread still has to copy
        assert region.users == 1 and region.fd >= 0  # not closed under the running copy
        pool.gate.set()
        for _ in range(1000):
            if region.fd == -1:
                break
            await asyncio.sleep(0.01)
        assert region.users == 0 and region.fd == -1  # closed once the copy finished

    asyncio.run(main())


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "polling (no pidfd: seccomp, old kernel)"])
def test_exited_process_regions_are_released(key: str, pidfd: bool) -> None:
    async def main() -> None:
        reg = SharedMemoryRegistry()
        child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        peer = Peer(child.pid, os.getuid(), os.getgid(), os.pidfd_open(child.pid) if pidfd else None)
        reg.register(peer, "in", key, 0, 16)
        assert reg.count() == 1
        assert child.stdin is not None
        child.stdin.close()
        child.wait(10)
        for _ in range(1000):
            if reg.count() == 0:
                break
            await asyncio.sleep(0.01)
        assert reg.count() == 0

    asyncio.run(main())
