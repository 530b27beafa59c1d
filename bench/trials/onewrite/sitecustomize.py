"""Loaded by Python at start-up when this folder is on PYTHONPATH (bench/overhead.py puts it
there for one edged daemon): uvicorn's httptools protocol writes a response's head and its body
with two ``transport.write`` calls, two syscalls that can wake the client twice. This trial
holds the head back and writes head and body in one call when the body is complete in one
message (every edged response). A trial of a change to edged's HTTP transport, made without
touching edged's code."""

from __future__ import annotations

from typing import Any


class _Collect:
    """Stands in for the transport during one ``send``: writes are kept, the rest passes."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.chunks: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.chunks.append(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def _patch() -> None:
    from uvicorn.protocols.http import httptools_impl

    cycle = httptools_impl.RequestResponseCycle
    original = cycle.send

    async def send(self: Any, message: Any) -> None:
        kind = message["type"]
        held: list[bytes] | None = getattr(self, "_held_head", None)
        if kind == "http.response.start" or (
            held is not None and kind == "http.response.body" and not message.get("more_body", False)
        ):
            real = self.transport
            collect = _Collect(real)
            if held:
                collect.chunks = held
            self.transport = collect
            try:
                await original(self, message)
            finally:
                self.transport = real
            if kind == "http.response.start":
                self._held_head = collect.chunks
            else:
                self._held_head = None
                real.write(b"".join(collect.chunks))
            return
        if held:
            self._held_head = None
            self.transport.write(b"".join(held))
        await original(self, message)

    cycle.send = send  # type: ignore[method-assign]


_patch()
