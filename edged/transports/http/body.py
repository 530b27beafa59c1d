"""Request bodies in and response bodies out: bounded reads and Content-Encoding (gzip, deflate).

tritonclient compresses request bodies on request (``request_compression_algorithm``) and asks for
compressed answers (``response_compression_algorithm``); Inference-Header-Content-Length always
counts the uncompressed bytes, in both directions, as in Triton.

Every body is bounded by server.max_body twice: as sent (a compressed body above it is refused
like any other) and as inflated. Inflating runs in steps whose output is capped, so a zip bomb
(1 GiB of zeros is 1 MB of gzip) is a 413 as soon as max_body bytes have come out, having
allocated no more than that. A small body is inflated on the event loop (a few tens of
microseconds); the rest of a larger one, and every large compression, runs on a worker thread
(zlib releases the interpreter lock while it works).

All bodies together are bounded too (``BodyBudget``, server.bodies_in_flight): eight connections
each sending a small gzip body that inflates to max_body would otherwise hold eight times
max_body. A body larger than one read takes its bytes from the budget as they arrive or inflate,
and gives them back when the last view of it goes (whoever read it: the infer route, a decoded
tensor, the generation routes); a body that finds the budget taken is refused with 503
``body_budget``, and the client may retry.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from edged.errors import (
    BadRequestError,
    ClientGoneError,
    PayloadTooLargeError,
    UnsupportedEncodingError,
)
from edged.host import malloc
from edged.transports.budget import BodyBudget
from edged.wire.decode import Part, parse_header_length

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Headers = list[tuple[bytes, bytes]]

# zlib's window bits for each Content-Encoding read: gzip framing, or zlib framing for "deflate"
# (what RFC 9110 means by it, and what tritonclient and Triton write).
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
# A compressed body up to this size is inflated on the loop, up to _INLINE_OUT bytes of output;
# whatever remains goes to a worker thread.
_INLINE_IN = 16 * 1024
_INLINE_OUT = 64 * 1024
# Output per zlib call, and input fed per call (zlib copies the unconsumed input after each call:
# feeding a large body whole would copy it once per output step).
_STEP_OUT = 1 << 20
_STEP_IN = 64 * 1024
# Responses up to this size are compressed on the loop (about 0.2 ms at level 1 on the 2-core
# development machine); larger ones on a worker thread.
_INLINE_COMPRESS = 16 * 1024
# An inflation that made more than this gives its freed steps back to the kernel at once.
_TRIM_AFTER = 16 * 1024 * 1024
# zlib level 1: on a small board's CPU the fastest level costs a fraction of level 6 for a
# slightly larger body (tensors compress poorly at any level).
_LEVEL = 1


class _Taken:
    """What one body has taken from the budget, given back on failure or handed to its buffer."""

    def __init__(self, budget: BodyBudget | None) -> None:
        self.budget = budget
        self.n = 0

    def take(self, n: int) -> None:
        if self.budget is not None:
            self.budget.take(n)
            self.n += n

    def hand_to(self, buf: np.ndarray) -> memoryview:
        n, self.n = self.n, 0
        return buf.data if self.budget is None else self.budget.hold(buf, n)

    def give_back(self) -> None:
        if self.budget is not None and self.n:
            self.budget.give(self.n)
        self.n = 0


def header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


class BodyHeaders(NamedTuple):
    """What reading a body (and the infer route) takes from the request's headers, found in one
    pass over them: the first Content-Length, and every Content-Encoding and
    Inference-Header-Content-Length, in order (empty tuples when there are none)."""

    length: bytes | None
    encodings: tuple[bytes, ...]
    header_lengths: tuple[bytes, ...]


def body_headers(scope: Scope) -> BodyHeaders:
    raw = scope["headers"]  # a list (uvicorn's, and the generation routes' own scopes)
    found = dict(raw)
    if len(found) == len(raw):  # no name twice (nearly every request): no loop in Python
        given, encoding, header_length = (
            found.get(b"content-length"),
            found.get(b"content-encoding"),
            found.get(b"inference-header-content-length"),
        )
        return BodyHeaders(
            None if given is None else bytes(given),
            () if encoding is None else (encoding,),
            () if header_length is None else (header_length,),
        )
    length: bytes | None = None
    encodings: tuple[bytes, ...] = ()
    header_lengths: tuple[bytes, ...] = ()
    for key, value in scope["headers"]:
        if key == b"content-length":
            if length is None:
                length = bytes(value)
        elif key == b"content-encoding":
            encodings += (value,)
        elif key == b"inference-header-content-length":
            header_lengths += (value,)
    return BodyHeaders(length, encodings, header_lengths)


async def read_body(
    scope: Scope,
    receive: Receive,
    max_body: int,
    headers: BodyHeaders | None = None,
    budget: BodyBudget | None = None,
) -> bytes | memoryview:
    """The request body, inflated when it is gzip or deflate, at most ``max_body`` bytes either way.
    An encoding edged does not read is refused (415) before the body is read. ``headers``: the
    request's, when the caller already walked them (``body_headers``). ``budget``: what all bodies
    in flight may hold together (None: unbounded, for bounded internal bodies)."""
    if headers is None:
        headers = body_headers(scope)
    if not headers.encodings:
        return await _read_raw(headers.length, receive, max_body, budget)
    wbits = _request_wbits(headers.encodings)
    body = await _read_raw(headers.length, receive, max_body, budget)
    if wbits is None:
        return body
    return await inflate(body, wbits, max_body, budget)


def _request_wbits(values: Sequence[bytes]) -> int | None:
    if not values:
        return None
    tokens = [t.strip().lower() for v in values for t in v.decode("latin-1").split(",") if t.strip()]
    tokens = [t for t in tokens if t != "identity"]
    if not tokens:
        return None
    if len(tokens) > 1:
        raise UnsupportedEncodingError(f"Content-Encoding '{', '.join(tokens)[:100]}': one encoding at most")
    wbits = _WBITS.get(tokens[0])
    if wbits is None:
        raise UnsupportedEncodingError(
            f"Content-Encoding '{tokens[0][:64]}' is not supported; send gzip, deflate or identity"
        )
    return wbits


async def _read_raw(
    raw: bytes | None, receive: Receive, max_body: int, budget: BodyBudget | None = None
) -> bytes | memoryview:
    """The body as sent; ``raw``: its Content-Length header, if any."""
    length = None
    if raw is not None:
        length = parse_header_length(raw, "Content-Length")
        if length > max_body:
            raise PayloadTooLargeError(f"body of {length} bytes exceeds the limit of {max_body} (server.max_body)")
    message = await receive()
    if message["type"] == "http.disconnect":
        raise ClientGoneError("the client closed the connection")
    body: bytes = message.get("body", b"")
    if not message.get("more_body"):
        return body  # the common case: one message, no copy
    if length is None:  # chunked transfer: sizes unknown until the end
        return await _read_chunked(body, message, receive, max_body, budget)
    # Each chunk is copied into place as it arrives: joining a large body at the end would
    # hold the loop for one long copy, and so would zero-filling a bytearray (a 128 MiB body:
    # 100-250 ms on a loaded 2-core machine). np.empty maps untouched pages instead.
    taken = _Taken(budget)
    taken.take(length)
    view = taken.hand_to(np.empty(length, np.uint8))  # given back when the body goes, read or not
    size = 0
    while True:
        end = size + len(body)
        if end > length:
            raise BadRequestError(f"the body is longer than its Content-Length ({length})")
        view[size:end] = body
        size = end
        if not message.get("more_body"):
            return view[:size]
        message = await receive()
        if message["type"] == "http.disconnect":  # gone mid-upload: never decode half a body
            raise ClientGoneError("the client closed the connection")
        body = message.get("body", b"")


async def _read_chunked(
    body: bytes, message: dict[str, Any], receive: Receive, max_body: int, budget: BodyBudget | None
) -> bytes | memoryview:
    parts = [body]
    size = len(body)
    taken = _Taken(budget)
    try:
        taken.take(len(body))
        while message.get("more_body"):
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGoneError("the client closed the connection")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > max_body:
                raise PayloadTooLargeError(f"body exceeds the limit of {max_body} bytes (server.max_body)")
            taken.take(len(chunk))
            parts.append(chunk)
        joined = b"".join(parts)
        parts.clear()
        return taken.hand_to(np.frombuffer(joined, np.uint8))
    finally:
        taken.give_back()


# --- inflating request bodies -----------------------------------------------------------------


class _Inflater:
    """One compressed body, inflated in bounded steps."""

    def __init__(self, body: bytes | memoryview, wbits: int, limit: int, budget: BodyBudget | None = None) -> None:
        self.taken = _Taken(budget)
        self.src = memoryview(body)
        self.pos = 0
        self.limit = limit
        self.what = "gzip" if wbits > zlib.MAX_WBITS else "deflate"
        self.inflater = zlib.decompressobj(wbits)
        self.chunks: list[bytes] = []
        self.size = 0

    def run(self, budget: int) -> bool:
        """Inflate until the end of the stream (True) or until ``budget`` more bytes came out."""
        goal = self.size + budget
        z = self.inflater
        while not z.eof:
            if self.size >= goal:
                return False
            data: bytes | memoryview = z.unconsumed_tail
            if not data:
                data = self.src[self.pos : self.pos + _STEP_IN]
                self.pos += len(data)
            try:
                out = z.decompress(data, min(_STEP_OUT, goal - self.size, self.limit + 1 - self.size))
            except zlib.error as e:
                raise BadRequestError(f"the {self.what} request body is corrupt: {e}") from None
            if out:
                self.size += len(out)
                if self.size > self.limit:
                    raise PayloadTooLargeError(
                        f"the {self.what} request body inflates to more than {self.limit} bytes (server.max_body)"
                    )
                self.taken.take(len(out))
                self.chunks.append(out)
            elif not data:
                raise BadRequestError(f"the {self.what} request body is truncated")
        if z.unused_data or self.pos < len(self.src):
            raise BadRequestError(f"bytes follow the end of the {self.what} stream in the request body")
        return True

    def finish(self) -> bytes | memoryview:
        """The inflated body in one buffer; each step's output is freed as it is copied in."""
        if len(self.chunks) == 1:
            chunk = self.chunks.pop()
            return chunk if self.taken.budget is None else self.taken.hand_to(np.frombuffer(chunk, np.uint8))
        buf = np.empty(self.size, np.uint8)
        pos = 0
        self.chunks.reverse()
        while self.chunks:
            chunk = self.chunks.pop()
            buf[pos : pos + len(chunk)] = np.frombuffer(chunk, np.uint8)
            pos += len(chunk)
        return self.taken.hand_to(buf)

    def run_all(self) -> bytes | memoryview:
        """All of it, on a worker thread, which gives back what it took if it fails: the loop
        may have stopped waiting for it (a client gone), so only this thread touches ``taken``."""
        try:
            self.run(self.limit + 1)
            body = self.finish()
        finally:
            self.discard()
        if self.size > _TRIM_AFTER:
            malloc.trim()  # the freed steps, back to the kernel from this thread's arena
        return body

    def discard(self) -> None:
        """Drop the steps not yet in a body and give back what they took (nothing once finished)."""
        self.chunks.clear()
        self.taken.give_back()


async def inflate(
    body: bytes | memoryview, wbits: int, limit: int, budget: BodyBudget | None = None
) -> bytes | memoryview:
    """``body`` inflated (gzip or zlib framing per ``wbits``), at most ``limit`` bytes."""
    job = _Inflater(body, wbits, limit, budget)
    if len(body) <= _INLINE_IN:
        try:
            if job.run(_INLINE_OUT):
                return job.finish()
        except BaseException:
            job.discard()
            raise
    return await asyncio.to_thread(job.run_all)


# --- compressing responses --------------------------------------------------------------------


def accepted_encoding(scope: Scope) -> str | None:
    """gzip or deflate when Accept-Encoding allows it (gzip first), else None."""
    raw = header(scope, b"accept-encoding")
    if not raw:
        return None
    weights: dict[str, float] = {}
    for item in raw.decode("latin-1").lower().split(","):
        name, _, params = item.partition(";")
        q = 1.0
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        weights[name.strip()] = q
    for name in ("gzip", "deflate"):
        if weights.get(name, weights.get("*", 0.0)) > 0:
            return name
    return None


def _compress(parts: Sequence[Part], encoding: str) -> list[bytes]:
    wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
    z = zlib.compressobj(_LEVEL, zlib.DEFLATED, wbits)
    out = [z.compress(p) for p in parts]
    out.append(z.flush())
    return [o for o in out if o]


async def compress(parts: Sequence[Part], size: int, encoding: str) -> list[bytes]:
    """``parts`` (``size`` bytes in all) compressed as one gzip or deflate stream."""
    if size <= _INLINE_COMPRESS:
        return _compress(parts, encoding)
    return await asyncio.to_thread(_compress, parts, encoding)
