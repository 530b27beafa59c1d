"""The daemon's HTTP stack served in the test's process for the tests of answers made at once on
the connection (transports/http/connection.py's ``Direct``): uvicorn with edged's protocol on a
real Unix socket, a real registry and ONNX Runtime model (the demo's tiny MLP, made to run
inline), what the app answered at once, and raw HTTP/1.1 requests and answers to exchange with
it."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson

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
