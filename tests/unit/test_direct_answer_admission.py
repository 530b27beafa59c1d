"""Requests kept by the connection for their body (transports/http/connection.py's ``Direct``)
and admitted at their head: served by a daemon stopping since, declined at the body to the ASGI
call, counted when their client leaves mid-body, ended by a stop that drains; and the daemon's
own warm-up, answered at once and counted nowhere while a client's request waits for readiness.
The daemon's real HTTP stack in process, as in test_direct_answer_parity.py."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.unit.direct_answer_stack import DIRECT, ROUTED, Served, X, answer, binary, exchange, http, run


async def until(cond: Callable[[], object], timeout: float = 30) -> None:
    """Wait for ``cond`` on the loop, with a deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.001)


async def head_then(s: Served, request: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int]:
    """A connection that has sent ``request``'s head, once the daemon has kept it for its body."""
    cut = request.index(b"\r\n\r\n") + 4
    s.wanted.clear()
    reader, writer = await s.connect()
    writer.write(request[:cut])
    await writer.drain()
    await until(lambda: s.wanted)
    assert s.wanted == ["m"]
    return reader, writer, cut


@pytest.mark.parametrize("how", ["answered at once", "declined at the body", "a real stop"])
def test_a_request_admitted_at_its_head_is_served_by_a_daemon_stopping_since(tmp_path: Path, how: str) -> None:
    """The drain serves what it admitted: acceptance is decided at the head, as the ASGI call
    decides it when it starts there, whether the request is then answered at once, declined at
    its body (the instance busy) or promoted by the stop itself (the body still to come)."""
    body, length = binary(X)
    request = http(DIRECT, body, length)

    async def test(s: Served) -> None:
        (expected,) = await exchange(s, request)
        s.kinds.clear()
        queue = s.svc.registry.models["m"].queue
        assert queue is not None
        reader, writer, cut = await head_then(s, request)
        s.app.accepting = False  # the daemon's stop begins (Daemon._stop's first step)
        stopping = None
        if how == "a real stop":
            s.stack.config.timeout_graceful_shutdown = 30
            stopping = asyncio.create_task(s.stack.shutdown())  # then uvicorn's drain
            await asyncio.sleep(0)
        if how == "declined at the body":
            queue._inline_lock.acquire()  # what a larger request running on the instance holds
        try:
            writer.write(request[cut:])
            if how == "declined at the body":
                await until(lambda: s.kinds)
        finally:
            if how == "declined at the body":
                queue._inline_lock.release()
        got = await answer(reader)
        writer.close()
        assert got.startswith(b"HTTP/1.1 200"), got
        assert got.partition(b"\r\n\r\n")[2] == expected.partition(b"\r\n\r\n")[2]
        assert s.kinds == {"answered at once": ["answer"], "declined at the body": ["declined"], "a real stop": []}[how]
        if stopping is not None:
            await asyncio.wait_for(stopping, 30)
        else:
            assert (await exchange(s, request))[0].startswith(b"HTTP/1.1 503")  # a new one is refused

    run(tmp_path, test)


def test_a_request_declined_at_its_body_is_served_by_the_asgi_call(tmp_path: Path) -> None:
    """The model's instance busy when the body comes (a larger request runs on it): ``now``
    declines, having done nothing, and the ASGI call queues the request for the worker."""
    body, length = binary(X)
    request = http(DIRECT, body, length)

    async def test(s: Served) -> None:
        (expected,) = await exchange(s, request)
        s.kinds.clear()
        stats = s.svc.metrics.model("m")
        before = stats.requests
        queue = s.svc.registry.models["m"].queue
        assert queue is not None
        reader, writer, cut = await head_then(s, request)
        queue._inline_lock.acquire()  # what a larger request running on the instance holds
        try:
            writer.write(request[cut:])
            await until(lambda: s.kinds)
        finally:
            queue._inline_lock.release()
        assert await answer(reader) == expected
        writer.close()
        assert s.kinds == ["declined"] and stats.requests == before + 1

    run(tmp_path, test)


def test_a_client_gone_mid_body_is_counted_as_before(tmp_path: Path) -> None:
    """A request kept for its body whose client leaves: the ASGI call reads the disconnect and
    counts it (client_disconnected), as when it started at the head."""
    body, length = binary(X)

    async def test(s: Served) -> None:
        stats = s.svc.metrics.model("m")
        before = (stats.requests, stats.failures)
        _, writer, _ = await head_then(s, http(DIRECT, body, length))
        writer.close()
        await until(lambda: (stats.requests, stats.failures) != before)
        assert (stats.requests, stats.failures) == (before[0] + 1, before[1] + 1)
        assert not s.kinds

    run(tmp_path, test)


def test_a_stop_with_a_body_still_to_come_drains_then_closes(tmp_path: Path) -> None:
    """The drain waits for a request kept for its body, then ends it as it ends any request
    still running: a 500 and the connection closed (not left open, unanswered)."""
    body, length = binary(X)

    async def test(s: Served) -> None:
        reader, writer, _ = await head_then(s, http(DIRECT, body, length))
        s.stack.config.timeout_graceful_shutdown = 0.5
        await asyncio.wait_for(s.stack.shutdown(), 30)
        got = await asyncio.wait_for(reader.read(), 30)  # to the end: the daemon closed it
        writer.close()
        assert got.startswith(b"HTTP/1.1 500"), got

    run(tmp_path, test)


def test_the_daemons_own_warm_up_is_answered_at_once_and_counted_nowhere(tmp_path: Path) -> None:
    """Before READY=1 the daemon warms the path through its own socket: answered at once (so that
    no client's request runs that code first), left out of metrics and statistics; a request from
    this process is the daemon's own here (the stack runs in the test's process)."""
    body, length = binary(X)
    request = http(DIRECT, body, length)

    async def test(s: Served) -> None:
        stats = s.svc.metrics.model("m")

        def counts() -> tuple[int, int]:
            model_stats = s.svc.stats.report("m")["model_stats"][0]
            return stats.requests, model_stats["inference_stats"]["success"]["count"]

        before = counts()
        s.svc.warming = True
        try:
            (warm,) = await exchange(s, request)
        finally:
            s.svc.warming = False
        assert warm.startswith(b"HTTP/1.1 200") and s.kinds == ["answer"]
        assert counts() == before
        assert await exchange(s, request) == [warm]
        assert counts() == (before[0] + 1, before[1] + 1)

    run(tmp_path, test)


CLIENT = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(60)
s.connect(sys.argv[1])
s.sendall(sys.stdin.buffer.read())
print(s.recv(200).split(b"\\r\\n")[0].decode())
"""


@pytest.mark.parametrize("path", [DIRECT, ROUTED])
def test_a_clients_request_during_the_warm_up_waits_for_readiness(tmp_path: Path, path: str) -> None:
    """While the daemon warms (before READY=1) only its own requests are served: a client's (from
    another process) waits for readiness, uncounted until then, whichever path it takes."""
    body, length = binary(X)

    async def test(s: Served) -> None:
        stats = s.svc.metrics.model("m")
        before = stats.requests
        s.svc.ready.clear()
        s.svc.warming = True
        try:
            client = await asyncio.create_subprocess_exec(
                sys.executable, "-c", CLIENT, str(s.sock), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
            )
            assert client.stdin is not None and client.stdout is not None
            client.stdin.write(http(path, body, length))
            client.stdin.close()
            await until(lambda: s.stack.server_state.tasks)  # the request is in, its ASGI call running
            await asyncio.sleep(0.3)  # time passing is what is tested: no answer, nothing counted
            assert client.returncode is None and stats.requests == before
        finally:
            s.svc.warming = False
            s.svc.ready.set()
        line = (await asyncio.wait_for(client.stdout.read(), 60)).decode().strip()
        assert line == "HTTP/1.1 200 OK" and stats.requests == before + 1
        assert s.kinds == (["declined"] if path == DIRECT else [])

    run(tmp_path, test)
