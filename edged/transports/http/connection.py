"""The connection layer: uvicorn's httptools protocol with edged's bounds.

uvicorn parses HTTP and runs the ASGI app; this module adds what a daemon facing untrusted local
clients needs and uvicorn does not do (design section 2):

- a read timeout: a connection must deliver a whole request within ``read_timeout_s`` of its start
  (or of the first byte of a following request). Connections that never send a byte, or stall
  mid-headers or mid-body, are answered 408 and closed; idle keep-alive uses ``keepalive_s``;
- header bounds: the request line plus headers above ``max_header_size`` bytes, or more than
  ``max_headers`` fields, are answered 431: checked once the section is parsed, and while it is
  incomplete on the bytes fed so far, so no more than one read of it is ever parsed;
- a connection limit shared by every listener: one more is answered 503 and closed, the others
  keep being served;
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
from dataclasses import dataclass
from itertools import chain
from typing import Any

import httptools
import orjson
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from edged.config import Config, parse_size
from edged.ratelog import RateLimitedLog
from edged.transports.http.inline import ANSWERS_PER_READ, InlineAnswers, missing_internals
from edged.transports.peer import ACCESS_KEY, PEER_KEY, ListenerAccess, Peer, close_peer, peer_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConnectionLimits:
    max_header_size: int = 16 * 1024
    max_headers: int = 100
    read_timeout_s: float = 30.0
    max_connections: int = 512

    @classmethod
    def from_config(cls, cfg: Config) -> ConnectionLimits:
        s = cfg.server
        return cls(parse_size(s.max_header_size), s.max_headers, s.read_timeout_s, s.max_connections)


class ConnectionSlots:
    """Open connections across every listener, and the log of refusals: at most one line per
    kind every ratelog.EVERY_S seconds (with the count since), so a flood cannot fill the journal."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.open = 0
        self._log = RateLimitedLog(log)

    def note(self, kind: str, message: str) -> None:
        self._log.note(logging.WARNING, kind, "%s", message)


class _Reject(Exception):
    """Raised from a parser callback to stop parsing; data_received answers it."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def error_response(status: int, code: str, message: str, reason: str) -> bytes:
    body = orjson.dumps({"error": message, "code": code})
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


_REASONS = {408: "Request Timeout", 431: "Request Header Fields Too Large", 503: "Service Unavailable"}


class EdgedProtocol(InlineAnswers):
    def __init__(self, *args: Any, slots: ConnectionSlots, access: ListenerAccess, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._slots = slots
        self._access = access
        self._limits = slots.limits
        self._counted = False
        self._peer: Peer | None = None
        self._read_timer: asyncio.TimerHandle | None = None
        self._in_headers = True  # between requests counts as the header phase of the next one
        self._raw_header_bytes = 0

    # --- connection ---

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self._slots.open >= self._limits.max_connections:
            self._slots.note(
                "limit", f"connection refused: {self._slots.open} connections open (server.max_connections)"
            )
            self._answer(
                503,
                "too_many_connections",
                f"edged serves at most {self._limits.max_connections} connections "
                "(server.max_connections); retry later",
            )
            return
        self._slots.open += 1
        self._counted = True
        try:
            self._peer = peer_of(transport.get_extra_info("socket"))
        except OSError as e:
            self._slots.note("cred", f"cannot read the peer's credentials: {e}")
        self._arm_read_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._counted:
            self._slots.open -= 1
            self._counted = False
        self._cancel_read_timer()
        close_peer(self._peer)
        self._peer = None
        super().connection_lost(exc)

    def _answer(self, status: int, code: str, message: str) -> None:
        if not self.transport.is_closing():
            self.transport.write(error_response(status, code, message, _REASONS.get(status, "")))
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
        if self.transport.is_closing():
            return  # refused or timed out: whatever else arrives is not read
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
                self._answer(400, "bad_request", "invalid HTTP request")
        except httptools.HttpParserError:
            self._answer(400, "bad_request", "invalid HTTP request")
        except httptools.HttpParserUpgrade:
            self._answer(400, "bad_request", "protocol upgrades are not supported")

    def _reject(self, r: _Reject) -> None:
        self._slots.note(r.code, f"refused a request: {r.message}")
        self._answer(r.status, r.code, r.message)

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
        self._in_headers = False
        super().on_headers_complete()

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
