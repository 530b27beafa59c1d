"""The descriptor socket in process, on a real event loop with real sockets: what a hostile
client's descriptors cost the loop."""

from __future__ import annotations

import array
import asyncio
import contextlib
import os
import socket
import struct
import time
from pathlib import Path

import orjson
import pytest

from edged.transports.shm.memfd_socket import FdSocket
from edged.transports.shm.regions import SharedMemoryRegistry
from tests.helpers import FREEZE_S


def serving(loop: asyncio.AbstractEventLoop, tmp_path: Path) -> tuple[FdSocket, socket.socket]:
    """A descriptor socket served on ``loop``, and a client connected to it (the connection waits
    in the backlog until the loop runs and accepts it)."""
    path = str(tmp_path / "edged.sock.fd")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(8)
    fds = FdSocket(listener, SharedMemoryRegistry(), 8)
    fds.start(loop)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    client.connect(path)
    return fds, client


LINGER_S = 2 * FREEZE_S


def lingering_socket() -> tuple[int, socket.socket]:
    """A connected TCP socket with unsent data and SO_LINGER of LINGER_S: its last close blocks
    that long. Returns its descriptor and the listening peer (kept open, never read)."""
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    client.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        while True:
            client.send(b"x" * 65536)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, int(LINGER_S)))
    return client.detach(), server


async def _lateness_while(loop: asyncio.AbstractEventLoop, seconds: float) -> float:
    """The largest delay of a 10 ms timer on this loop over ``seconds``."""
    worst = 0.0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        await asyncio.sleep(0.01)
        worst = max(worst, time.monotonic() - t0 - 0.01)
    return worst


def test_a_descriptor_whose_close_blocks_is_closed_off_the_loop(tmp_path: Path) -> None:
    async def main() -> tuple[dict[str, str], float]:
        loop = asyncio.get_running_loop()
        fds, client = serving(loop, tmp_path)
        fd, server = lingering_socket()
        try:
            msg = orjson.dumps({"name": "r", "byte_size": 64})
            client.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
            os.close(fd)  # before the loop runs again: the daemon's copy is the last one
            client.setblocking(False)
            lateness = asyncio.ensure_future(_lateness_while(loop, 1.0))
            answer = orjson.loads(await asyncio.wait_for(loop.sock_recv(client, 4096), 10))
            return answer, await lateness
        finally:
            client.close()
            fds.close()
            server.close()

    answer, lateness = asyncio.run(main())
    assert answer["code"] == "shm_invalid" and "not a memfd" in answer["error"]
    # Closed on the loop, the descriptor would hold it for the whole linger (LINGER_S, twice
    # FREEZE_S): far above a timer's ordinary lateness.
    assert lateness < FREEZE_S, f"the loop was held {lateness * 1000:.0f} ms while a descriptor closed"


@pytest.mark.parametrize("count", [1, 70])
def test_a_connection_with_many_descriptors_still_to_close_is_answered(tmp_path: Path, count: int) -> None:
    """Past MAX_PENDING_CLOSES the connection is not read until the closer catches up; then it is."""

    async def main() -> list[dict[str, str]]:
        loop = asyncio.get_running_loop()
        fds, client = serving(loop, tmp_path)
        client.setblocking(False)
        answers = []
        try:
            for _ in range(count):
                r, w = os.pipe()
                client.sendmsg([b"{}"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [r, w]))])
                os.close(r)
                os.close(w)
                answers.append(orjson.loads(await asyncio.wait_for(loop.sock_recv(client, 4096), 10)))
        finally:
            client.close()
            fds.close()
        return answers

    answers = asyncio.run(main())
    assert len(answers) == count
    assert all(a["code"] == "bad_request" and "exactly one descriptor" in a["error"] for a in answers)
