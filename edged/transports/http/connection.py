"""The connection layer: uvicorn's httptools protocol with edged's bounds.

uvicorn parses HTTP and runs the ASGI app; this module adds what a daemon facing untrusted local
clients needs and uvicorn does not do (design section 2):

- a read timeout: a connection must deliver a whole request within ``read_timeout_s`` of its start
  (or of the first byte of a following request). Connections that never send a byte, or stall
  mid-headers or mid-body, are answered 408 and closed; idle keep-alive uses ``keepalive_s``;
- header bounds: the request line plus headers above ``max_header_size`` bytes, or more than
  ``max_headers`` fields, are answered 431: checked once the section is parsed, and while it is
  incomplete on the bytes fed so far, so no more than one read of it is ever parsed;
- connection slots shared fairly by every listener (slots.py): a share per peer, pending TCP
  connections that have shown no token yet first to go, a reserve for health checks; a connection
  that finds no slot is answered 503 and closed, the others keep being served;
- the token of a TCP listener checked on a connection's first request: without it the answer is
  401 and the connection is closed, so an unauthenticated client holds no slot;
- the peer's credentials (SO_PEERCRED and a pidfd) in the ASGI scope as ``edged.peer``, which the
  shared memory extension and ``admin_group`` use;
- answers made at once (inline.py, the class this one extends): an infer request to a model
  that runs inline is answered on the parser's callback once its body is whole, with no task and
  no ASGI call.

uvicorn is driven through internals it does not promise to keep (HttpToolsProtocol's parser
callbacks and fields, Server.servers/lifespan/shutdown): pyproject.toml bounds its version and
``check_uvicorn`` fails the start loudly, naming what moved, if they change. The listeners
(which sockets, which policy) are set up in listener.py.
"""

from __future__ import annotations

import asyncio
import logging
from itertools import chain
from typing import Any

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from edged.transports.http.inline import ANSWERS_PER_READ, InlineAnswers, missing_internals
from edged.transports.http.methods import error_body
from edged.transports.http.slots import ConnectionSlots, Holder, Slot
from edged.transports.peer import (
    ACCESS_KEY,
    PEER_KEY,
    ListenerAccess,
    Peer,
    close_peer,
    health_or_metrics,
    peer_of,
    token_matches,
)

log = logging.getLogger(__name__)


class _Reject(Exception):
    """Raised from a parser callback to stop parsing; data_received answers it (``path``: the
    request's, once known, for the shape of the answer's body)."""

    def __init__(self, status: int, code: str, message: str, path: bytes = b"") -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.path = status, code, message, path


def error_response(status: int, code: str, message: str, reason: str, path: bytes = b"") -> bytes:
    body = error_body(code, message, path)
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


_REASONS = {
    400: "Bad Request",
    401: "Unauthorized",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


class EdgedProtocol(InlineAnswers):
    def __init__(self, *args: Any, slots: ConnectionSlots, access: ListenerAccess, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._slots = slots
        self._access = access
        self._limits = slots.limits
        self._holder: Holder | None = None
        self._last_words: bytes | None = None  # an error to write once the answers before it are out
        self._peer: Peer | None = None
        self._read_timer: asyncio.TimerHandle | None = None
        self._in_headers = True  # between requests counts as the header phase of the next one
        self._raw_header_bytes = 0

    # --- connection ---

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        try:
            self._peer = peer_of(transport.get_extra_info("socket"))
        except OSError as e:
            self._slots.note("cred", f"cannot read the peer's credentials: {e}")
        self._holder = Holder(self._peer_key(transport), self._evicted)
        if self._slots.admit(self._holder, pending=self._access.token is not None) is None:
            refusal = self._refusal()
            self._slots.note("limit", refusal)
            self._answer(503, "too_many_connections", refusal + "; retry later")
            return
        self._arm_read_timer()

    def _peer_key(self, transport: asyncio.Transport) -> tuple[str, object]:
        """Whose share a connection takes: its uid on a Unix socket, its address on TCP."""
        if self._peer is not None:
            return ("uid", self._peer.uid)
        peername = transport.get_extra_info("peername")
        if isinstance(peername, tuple) and peername:
            return ("address", peername[0])
        return ("unix", None)  # a Unix peer whose credentials could not be read

    def _refusal(self) -> str:
        lim, key = self._limits, None if self._holder is None else self._holder.key
        if self._slots.held_by(key) >= lim.max_connections_per_peer:
            return (
                f"this peer holds {self._slots.held_by(key)} connections, its share "
                f"(server.max_connections_per_peer = {lim.max_connections_per_peer})"
            )
        return f"edged serves at most {lim.max_connections} connections (server.max_connections)"

    def _evicted(self) -> None:
        self._answer(503, "too_many_connections", "closed to make room: this connection showed no token")

    def connection_lost(self, exc: Exception | None) -> None:
        if self._holder is not None:
            self._slots.release(self._holder)
        self._cancel_read_timer()
        close_peer(self._peer)
        self._peer = None
        super().connection_lost(exc)

    def eof_received(self) -> bool:  # type: ignore[override]  # asyncio's: bool | None; uvicorn's: None
        """The client shut its side after sending (``shutdown(SHUT_WR)``, ``curl`` with a file
        body, some proxies): what it sent is still answered, then the connection closes. Returning
        False here, as uvicorn does, closed it at once: a request on a worker thread, or a
        generation (which took the close for a client gone), was never answered."""
        cycle = self.cycle
        partial = not self._in_headers or self._raw_header_bytes > 0  # a request cut off mid-way
        if partial or ((cycle is None or cycle.response_complete) and not self.pipeline):
            return False  # nothing whole in flight: close now (a cut-off request is a client gone)
        if cycle is not None:
            cycle.keep_alive = False  # the last request: closed once it is answered
        return True

    def _answer(self, status: int, code: str, message: str, path: bytes = b"") -> None:
        if not self.transport.is_closing():
            self.transport.write(error_response(status, code, message, _REASONS.get(status, ""), path))
            self.transport.close()

    # --- read timeout ---

    def _arm_read_timer(self) -> None:
        if self._read_timer is None:
            self._read_timer = self.loop.call_later(self._limits.read_timeout_s, self._on_read_timeout)

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _on_read_timeout(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        self._slots.note(
            "timeout", f"closed a connection that sent no whole request within {self._limits.read_timeout_s:g} s"
        )
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and (cycle.response_started or not cycle.more_body):
            # An answer is being written, or is still to come for a request received whole (the
            # stall is in a pipelined one): a 408 would land in the middle of it.
            self.transport.close()
            return
        self._answer(
            408,
            "request_timeout",
            f"the request was not received within {self._limits.read_timeout_s:g} s (server.read_timeout_s)",
        )

    # --- parsing, with bounds ---

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing() or self._last_words is not None:
            return  # refused, timed out, or ended by an error: whatever else arrives is not read
        self._unset_keepalive_if_required()
        self._answers_left = ANSWERS_PER_READ
        if self._in_headers:
            self._raw_header_bytes += len(data)
        try:
            self.parser.feed_data(data)
            if self._in_headers and self._raw_header_bytes > self._limits.max_header_size:
                # A single header line still being received is buffered by httptools, not seen by
                # on_header: bound the bytes fed while the header section is incomplete.
                raise _Reject(431, "header_too_large", self._too_large())
        except _Reject as r:
            self._reject(r)
        except httptools.HttpParserCallbackError as e:
            if isinstance(e.__context__, _Reject):
                self._reject(e.__context__)
            else:
                self._slots.note("invalid", f"invalid HTTP request: {e.__context__!r}")
                self._end(400, "bad_request", "invalid HTTP request")
        except httptools.HttpParserError:
            self._end(400, "bad_request", "invalid HTTP request")
        except httptools.HttpParserUpgrade:
            self._end(400, "bad_request", "protocol upgrades are not supported")

    def _reject(self, r: _Reject) -> None:
        self._slots.note(r.code, f"refused a request: {r.message}")
        self._end(r.status, r.code, r.message, r.path)

    def _end(self, status: int, code: str, message: str, path: bytes = b"") -> None:
        """End the connection with an error, after the answers of the requests received before it
        (pipelined in the same write: good, good, garbage answers 200, 200, 400)."""
        cycle = self.cycle
        if (cycle is None or cycle.response_complete) and not self.pipeline:
            self._answer(status, code, message, path)
            return
        self._last_words = error_response(status, code, message, _REASONS.get(status, ""), path)
        self.flow.pause_reading()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # starts the next pipelined request, if any
        cycle = self.cycle
        done = (cycle is None or cycle.response_complete) and not self.pipeline
        if self._last_words is not None and done and not self.transport.is_closing():
            self.transport.write(self._last_words)
            self.transport.close()

    def _too_large(self) -> str:
        return f"request headers exceed {self._limits.max_header_size} bytes (server.max_header_size)"

    def on_message_begin(self) -> None:
        # The connection is not idle. An answer made at once arms the keep-alive timer from
        # inside the parse; a request following it in the same read must cancel it, or it
        # closes the connection while that request is served (uvicorn cancels it only when data
        # is read or an answer completes: its own answers never complete inside a parse).
        self._unset_keepalive_if_required()
        super().on_message_begin()
        self.scope[PEER_KEY] = self._peer  # type: ignore[literal-required]
        self.scope[ACCESS_KEY] = self._access  # type: ignore[literal-required]
        self._arm_read_timer()

    def on_headers_complete(self) -> None:
        # The header section's bounds, checked once it is parsed: one read at most (the raw
        # bound in data_received stops a section that spans reads), so the work is bounded.
        headers = self.headers
        if len(headers) > self._limits.max_headers:
            raise _Reject(431, "too_many_headers", f"more than {self._limits.max_headers} headers (server.max_headers)")
        if (
            len(self.url) + sum(map(len, chain.from_iterable(headers))) + 4 * len(headers)
            > self._limits.max_header_size
        ):
            raise _Reject(431, "header_too_large", self._too_large())
        holder = self._holder
        if holder is not None and holder.pending:
            if not token_matches(headers, self._access.token):
                raise _Reject(
                    401,
                    "unauthorized",
                    "this listener needs 'Authorization: Bearer <token>' (server.tcp_token_file)",
                    self.url,
                )
            self._slots.authenticated(holder)
        reserve = holder is not None and holder.slot is Slot.RESERVE
        if reserve and not health_or_metrics(self.url):
            raise _Reject(
                503, "too_many_connections", self._refusal() + "; only health and metrics requests are answered now"
            )
        self._in_headers = False
        super().on_headers_complete()
        if reserve and self.cycle is not None:
            self.cycle.keep_alive = False  # a reserved slot serves one request

    def on_message_complete(self) -> None:
        self._cancel_read_timer()
        self._in_headers = True
        self._raw_header_bytes = 0
        super().on_message_complete()  # where a kept request is answered at once (inline.py)


# --- uvicorn internals relied on ---------------------------------------------------------------

_PROTOCOL_ATTRS = (
    "connection_made",
    "connection_lost",
    "data_received",
    "on_message_begin",
    "on_headers_complete",
    "on_message_complete",
    "on_response_complete",
    "_unset_keepalive_if_required",
)


def check_uvicorn() -> None:
    """Fail at start, naming what moved, if uvicorn no longer has what this module relies on."""
    missing = [a for a in _PROTOCOL_ATTRS if not hasattr(HttpToolsProtocol, a)]
    missing += missing_internals()
    missing += [f"Server.{a}" for a in ("startup", "shutdown") if not hasattr(uvicorn.Server, a)]
    if missing:
        raise RuntimeError(f"uvicorn {uvicorn.__version__} lacks what edged relies on: {', '.join(missing)}")
