"""Sending a generation's answer over ASGI: whole, or as Server-Sent Events, while watching for
the client to leave.

A generation runs for seconds on a model's slot threads. Its answer is sent whole once the
generation ends, or event by event as tokens come; either way the client's disconnect is watched
for meanwhile, and cancels the generation rather than letting it run for nobody. Errors take the
error body of the route's API: OpenAI's ``{"error": {...}}`` shape under ``/v1/``, edged's own
elsewhere.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson

from edged.errors import EdgedError
from edged.transports.http.methods import error_body

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

_JSON: Headers = [(b"content-type", b"application/json")]
_SSE: Headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


def sse(doc: dict[str, Any]) -> bytes:
    """One Server-Sent Event carrying ``doc`` as JSON."""
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def error_body_for(e: EdgedError, openai: bool) -> bytes:
    """The body of ``e``'s answer: in OpenAI's shape on the ``/v1/`` routes (``openai``), else edged's."""
    return error_body(e.code, e.message, "/v1/" if openai else "")


async def respond(send: Send, status: int, body: bytes, headers: Headers = _JSON) -> None:
    """Send a whole answer, its content-length given."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _until_done_or_gone(task: asyncio.Future[Any], receive: Receive, settle: bool) -> None:
    """Wait until ``task`` is done or the client has gone; a task still running then is cancelled
    and, with ``settle``, awaited until its cancellation has run (a stream's pump: closing its
    events there cancels the generation)."""
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            if settle:
                await asyncio.gather(task, return_exceptions=True)


async def until_disconnect(work: Awaitable[str], receive: Receive) -> str | None:
    """``work``'s result, or None once the client has gone (the generation is then cancelled)."""
    task = asyncio.ensure_future(work)
    await _until_done_or_gone(task, receive, settle=False)
    if not task.done() or task.cancelled():
        return None
    return task.result()


async def stream(send: Send, receive: Receive, events: AsyncIterator[bytes], openai: bool) -> None:
    """Send ``events`` as Server-Sent Events. Errors before the first event are a plain HTTP
    error; after it, one last ``error`` event. A disconnect stops the generation."""
    started = False

    async def pump() -> None:
        nonlocal started
        try:
            async for event in events:
                if not started:
                    await send({"type": "http.response.start", "status": 200, "headers": _SSE})
                    started = True
                await send({"type": "http.response.body", "body": event, "more_body": True})
        except EdgedError as e:
            if not started:
                raise
            await send({"type": "http.response.body", "body": b"data: " + error_body_for(e, openai) + b"\n\n"})
            return
        await send({"type": "http.response.body", "body": b""})

    task = asyncio.ensure_future(pump())
    await _until_done_or_gone(task, receive, settle=True)
    if task.done() and not task.cancelled():
        task.result()
