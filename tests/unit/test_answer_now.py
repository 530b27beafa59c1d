"""Answers made at once on the connection (transports/http/connection.py's ``Direct``), on the daemon's
real stack in process: uvicorn with edged's protocol on a real Unix socket, a real registry and
ONNX Runtime model (the demo's tiny MLP, made to run inline). Each answer made at once must be
byte for byte the answer of the ASGI call it replaces (the versioned path never takes the
shortcut), on the same connection, pipelined or not."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import socket
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from edged.serving.service import Service
from edged.transports.http.app import App
from edged.transports.http.listener import Listener, start
from edged.transports.peer import ListenerAccess
from edged.transports.shm.regions import SharedMemoryRegistry
from tests.unit.test_http_infer import inline_service

DIRECT = "/v2/models/m/infer"
ROUTED = "/v2/models/m/versions/1/infer"  # the same route, always through the ASGI call


class Served:
    """The daemon's HTTP stack in this process, and what its app answered at once."""

    def __init__(self, app: App, sock: Path, svc: Service, stack: Any) -> None:
        self.app, self.sock, self.svc, self.stack = app, sock, svc, stack
        self.kinds: list[str] = []  # per request ``now`` was asked: "answer", "rest" or "declined"
        now = app.now

        def spy(scope: dict[str, Any], body: bytes, name: str) -> Any:
            out = now(scope, body, name)
            self.kinds.append("declined" if out is None else "answer" if isinstance(out, tuple) else "rest")
            return out

        app.now = spy  # type: ignore[method-assign]
        wants = app.wants
        self.wanted: list[str | None] = []  # per request ``wants`` was asked, its answer

        def wants_spy(scope: dict[str, Any]) -> str | None:
            self.wanted.append(wants(scope))
            return self.wanted[-1]

        app.wants = wants_spy  # type: ignore[method-assign]

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_unix_connection(str(self.sock))


@contextlib.asynccontextmanager
async def served(tmp_path: Path, **server: Any) -> AsyncIterator[Served]:
    loop = asyncio.get_running_loop()
    reg, svc, rt = inline_service(tmp_path, loop, **server)
    await reg.load(rt, loop)
    assert rt.queue is not None and rt.queue.inline  # the case under test
    app = App(svc, SharedMemoryRegistry(), 1 << 20)
    path = tmp_path / "s.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(16)
    stack = await start(app, reg.cfg, [Listener(sock, ListenerAccess(str(path)))])
    try:
        yield Served(app, path, svc, stack)
    finally:
        await stack.shutdown()
        rt.queue.close()


def http(path: str, body: bytes, *headers: str, version: str = "1.1") -> bytes:
    head = [f"POST {path} HTTP/{version}", "Host: x", f"Content-Length: {len(body)}", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def binary(x: np.ndarray, output: bool = True) -> tuple[bytes, str]:
    """The tiny model's request with its tensor in the binary part; its header length header."""
    doc: dict[str, Any] = {
        "id": "r1",
        "inputs": [
            {"name": "x", "datatype": "FP32", "shape": list(x.shape), "parameters": {"binary_data_size": x.nbytes}}
        ],
    }
    if output:
        doc["outputs"] = [{"name": "probs", "parameters": {"binary_data": True}}]
    head = orjson.dumps(doc)
    return head + x.tobytes(), f"Inference-Header-Content-Length: {len(head)}"


def as_json(x: np.ndarray) -> bytes:
    return orjson.dumps(
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]}
    )


async def answer(reader: asyncio.StreamReader) -> bytes:
    """One whole answer: its head, and a body of its Content-Length."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    length = next(int(v) for k, _, v in (h.partition(b": ") for h in head.split(b"\r\n")) if k == b"content-length")
    return head + await reader.readexactly(length)


async def exchange(s: Served, *requests: bytes) -> list[bytes]:
    """The answers of ``requests``, each on a connection of its own."""
    out = []
    for request in requests:
        reader, writer = await s.connect()
        writer.write(request)
        out.append(await answer(reader))
        writer.close()
    return out


def run(tmp_path: Path, test: Callable[[Served], Any], **server: Any) -> None:
    async def main() -> None:
        async with served(tmp_path, **server) as s:
            await test(s)

    asyncio.run(main())


X = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)


def test_answers_made_at_once_are_the_asgi_calls_answers_byte_for_byte(tmp_path: Path) -> None:
    body, length = binary(X)
    cases = {
        "binary": (body, [length]),
        "json": (as_json(X), []),
        "binary input, json output": (binary(X, output=False)[0], [binary(X, output=False)[1]]),
        "connection close": (body, [length, "Connection: close"]),
        "wrong shape (400)": (as_json(np.zeros((1, 15), np.float32)), []),
        "malformed (400)": (b'{"inputs": [', []),
        "header length past the body (400)": (body, ["Inference-Header-Content-Length: 99999"]),
    }

    async def test(s: Served) -> None:
        stats = s.svc.metrics.model("m")
        for name, (data, headers) in cases.items():
            before = (stats.requests, stats.failures)
            at_once, routed = await exchange(s, http(DIRECT, data, *headers), http(ROUTED, data, *headers))
            assert at_once == routed, name
            assert s.kinds.pop() == "answer", name  # the first went through ``now``, the second did not
            assert not s.kinds
            once = (stats.requests - before[0], stats.failures - before[1])
            assert once[0] == 2 or once == (0, 0), (name, once)  # each counted as the other was
        # HTTP/1.0: no keep-alive, so the answer says connection: close and the socket closes
        at_once, routed = await exchange(
            s, http(DIRECT, body, length, version="1.0"), http(ROUTED, body, length, version="1.0")
        )
        assert at_once == routed and b"connection: close" in at_once

    run(tmp_path, test)


def test_pipelined_requests_in_one_write_are_answered_in_order(tmp_path: Path) -> None:
    body, length = binary(X)
    health = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
    requests = [http(DIRECT, body, length), http(ROUTED, body, length), health, http(DIRECT, as_json(X))] * 8

    async def test(s: Served) -> None:
        reader, writer = await s.connect()
        writer.write(b"".join(requests))
        got = [await answer(reader) for _ in requests]
        writer.close()
        # The first is answered at once; those behind the ASGI call it then meets are queued by
        # uvicorn and served by tasks (a read arriving after the queue drained may go at once).
        assert s.kinds.count("answer") >= 1 and "declined" not in s.kinds
        s.kinds.clear()
        alone = await exchange(s, *requests[:4])
        assert got == alone * 8
        assert s.kinds == ["answer"] * 2
        s.kinds.clear()
        reader, writer = await s.connect()
        writer.write(http(DIRECT, body, length) * 20)  # one read: a few at once, the rest queued
        got = [await answer(reader) for _ in range(20)]
        writer.close()
        assert got == [alone[0]] * 20
        assert 1 <= len(s.kinds) < 20 and set(s.kinds) == {"answer"}  # the loop is not held for all

    run(tmp_path, test)


def test_an_answer_made_at_once_arms_no_keepalive_timer_over_the_next_request(tmp_path: Path) -> None:
    """An answer made at once, with the next request's head in the same read: that request's
    body comes later than keepalive_s. The answer's keep-alive timer must not close the
    connection meanwhile (uvicorn cancels it only when data is read or an answer completes)."""
    body, length = binary(X)
    nxt = http(ROUTED, body, length)
    cut = nxt.index(b"\r\n\r\n") + 4

    async def test(s: Served) -> None:
        (expected,) = await exchange(s, nxt)
        reader, writer = await s.connect()
        writer.write(http(DIRECT, body, length) + nxt[:cut])
        await answer(reader)
        await asyncio.sleep(1.5)  # time passing is what is tested: past keepalive_s, within read_timeout_s
        writer.write(nxt[cut:])
        assert await answer(reader) == expected
        writer.close()

    run(tmp_path, test, keepalive_s=1)


def test_a_body_in_pieces_and_a_client_gone_mid_body(tmp_path: Path) -> None:
    body, length = binary(X)
    request = http(DIRECT, body, length)
    cut = request.index(b"\r\n\r\n") + 10

    async def test(s: Served) -> None:
        (expected,) = await exchange(s, request)
        reader, writer = await s.connect()
        writer.write(request[:cut])
        await writer.drain()
        await asyncio.sleep(0.05)  # not synchronisation: the rest may come in the same read or not
        writer.write(request[cut:])
        assert await answer(reader) == expected
        writer.close()
        reader, writer = await s.connect()
        writer.write(request[:cut])  # then gone: nothing was started for it, nothing is left
        await writer.drain()
        writer.close()
        assert await exchange(s, request) == [expected]
        assert s.kinds == ["answer"] * 3

    run(tmp_path, test)


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


def test_what_follows_an_answer_that_closed_the_connection_is_never_run(tmp_path: Path) -> None:
    """HTTP/1.0 asking for keep-alive, three requests in one write: uvicorn answers the first with
    connection: close and closes; the parser still finds the other two in the read. Neither may
    run (nobody would get its answer), as behind a cycle whose answer closes the connection."""
    body, length = binary(X)
    request = http(DIRECT, body, length, "Connection: keep-alive", version="1.0")

    async def test(s: Served) -> None:
        stats = s.svc.metrics.model("m")
        before = stats.requests
        reader, writer = await s.connect()
        writer.write(request * 3)
        got = await asyncio.wait_for(reader.read(), 30)  # to the end: the daemon closed it
        writer.close()
        assert got.count(b"HTTP/1.1 200") == 1 and b"connection: close" in got
        assert stats.requests == before + 1 and s.kinds == ["answer"]

    run(tmp_path, test)


def test_an_absurd_content_length_is_read_as_uvicorn_reads_it(tmp_path: Path) -> None:
    """Thousands of leading zeros (llhttp takes them): the same answer on both paths, not a 400
    for an integer too long to convert."""
    body, length = binary(X)
    head = f"Content-Length: {'0' * 5000}{len(body)}"

    def odd(path: str) -> bytes:
        return ("\r\n".join([f"POST {path} HTTP/1.1", "Host: x", head, length]) + "\r\n\r\n").encode() + body

    async def test(s: Served) -> None:
        at_once, routed = await exchange(s, odd(DIRECT), odd(ROUTED))
        assert at_once == routed
        assert b"invalid HTTP request" not in at_once, at_once  # the head was read, not refused

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


@pytest.mark.parametrize("encoding", ["gzip", None])
def test_an_answer_to_compress_is_finished_by_a_task(tmp_path: Path, encoding: str | None) -> None:
    body, length = binary(X)
    accept = [f"Accept-Encoding: {encoding}"] if encoding else []

    async def test(s: Served) -> None:
        at_once, routed = await exchange(s, http(DIRECT, body, length, *accept), http(ROUTED, body, length, *accept))
        assert at_once == routed
        assert s.kinds == ["rest"]
        head, _, data = at_once.partition(b"\r\n\r\n")
        assert b"vary: accept-encoding" in head
        assert (b"content-encoding: gzip" in head) == (encoding == "gzip")
        if encoding:
            assert gzip.decompress(data).startswith(b'{"model_name":"m"')

    run(tmp_path, test, compress_min_size="1B")


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
