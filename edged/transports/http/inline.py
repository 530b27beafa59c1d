"""Answers made at once on the connection, without a task or an ASGI call.

A request the app says it may answer from its head alone (``Direct.wants``: an infer request to a
model that runs inline) is kept for its body, of at most uvicorn's high-water mark, in place of
the request/response cycle uvicorn would make at the head (``_Kept``: what uvicorn's protocol
reads and writes of a cycle while a body comes in, and nothing else). Once the body is whole, the
app answers it on the parser's callback (``Direct.now``), written here as the cycle's send would
write it, with no task, no ASGI call and no loop iteration. Where the app declines, where only
the rest of the answer awaits, and where the client leaves or the daemon stops first, the kept
request becomes the cycle uvicorn would have made (``_promote``) and its task starts as uvicorn
starts one, the body so far in it: the ASGI call serves it as ever.

Only a few answers are made at once per read (ANSWERS_PER_READ): a client pipelining hundreds of
requests in one write must not hold the loop for all of them; the rest are served as uvicorn
serves them, one task each. docs/performance.md has the measurements.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import httptools
from uvicorn.protocols.http import httptools_impl
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

Answer = tuple[int, Any, list[tuple[bytes, bytes]]]
ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]

ANSWERS_PER_READ = 4


class Direct(Protocol):
    """What the app answers at once (transports/http/app.py's App)."""

    def wants(self, scope: dict[str, Any]) -> str | None: ...

    def now(self, scope: dict[str, Any], body: bytes, name: str) -> Answer | ASGIApp | None: ...


class _NoEvent:
    """uvicorn's protocol sets the cycle's event as the body comes in: nothing waits on a kept one."""

    @staticmethod
    def set() -> None:
        return None


class _Kept:
    """A request kept for its body, in place of its cycle (self.cycle) until it is answered or
    promoted: the state uvicorn's protocol (on_body, on_message_complete, connection_lost,
    shutdown, the next request's head) and edged's read timer read and write."""

    __slots__ = (
        "body",
        "disconnected",
        "keep_alive",
        "more_body",
        "name",
        "response_complete",
        "response_started",
        "scope",
    )
    message_event = _NoEvent()

    def __init__(self, scope: dict[str, Any], name: str, keep_alive: bool) -> None:
        self.scope, self.name, self.keep_alive = scope, name, keep_alive
        self.body = bytearray()
        self.more_body = True
        self.disconnected = self.response_started = self.response_complete = False


class InlineAnswers(HttpToolsProtocol):
    """uvicorn's protocol, with answers made at once (see the module's text)."""

    def __init__(self, *args: Any, direct: Direct | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._direct = direct
        self._answers_left = 0  # set per read by the subclass's data_received

    def on_headers_complete(self) -> None:
        if type(self.cycle) is _Kept and self.transport.is_closing():
            # An answer made at once in this read closed the connection (HTTP/1.0, say): what the
            # parser still finds in the read is never served (as uvicorn queues, and never starts,
            # requests behind a cycle whose answer closes the connection).
            return
        kept = self._keep()
        if kept is None:
            super().on_headers_complete()
        else:
            self.cycle = kept  # type: ignore[assignment]

    def _keep(self) -> _Kept | None:
        """The head of a request the app may answer at once, read as uvicorn reads it; None for
        any other (uvicorn then reads it again and makes its cycle)."""
        parser, existing = self.parser, self.cycle
        if (
            self._direct is None
            or self._answers_left <= 0
            or self.expect_100_continue  # the client waits for the app's first read to send its body
            or self.limit_concurrency is not None
            or parser.get_method() != b"POST"
            or parser.should_upgrade()
            or (existing is not None and not existing.response_complete)  # pipelined: uvicorn queues it
        ):
            return None
        length = dict(self.headers).get(b"content-length")
        if length is None or len(length) > 9 or not length.isdigit() or int(length) > HIGH_WATER_LIMIT:
            return None  # above the mark, uvicorn pauses reading until the app reads: never whole
        url = httptools.parse_url(self.url)
        if url.query is not None or b"%" in url.path:
            return None
        version = parser.get_http_version()
        scope = self.scope
        scope["method"] = "POST"
        if version != "1.1":
            scope["http_version"] = version
        scope["path"] = self.root_path + url.path.decode("ascii")
        scope["raw_path"] = self.root_path.encode("ascii") + url.path
        scope["query_string"] = b""
        name = self._direct.wants(scope)  # type: ignore[arg-type]
        if name is None:
            return None
        self._answers_left -= 1
        return _Kept(scope, name, version != "1.0" and parser.should_keep_alive())  # type: ignore[arg-type]

    def on_message_complete(self) -> None:
        super().on_message_complete()
        kept = self.cycle
        if type(kept) is _Kept and not kept.response_complete:
            self._answer_kept(kept)

    def _answer_kept(self, kept: _Kept) -> None:
        answer = None
        if not (kept.disconnected or self.flow.write_paused):  # else the ASGI call waits for the client
            assert self._direct is not None
            answer = self._direct.now(kept.scope, bytes(kept.body), kept.name)
        if answer is None:
            self._promote(kept, self.app)
        elif isinstance(answer, tuple):
            self._write(kept, *answer)
        else:  # the rest of the answer awaits: an ASGI app of its own, run as uvicorn runs one
            self._promote(kept, answer)

    def _write(self, kept: _Kept, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        """What the cycle's send writes for a whole answer of this app (no default headers: edged
        sends neither Server nor Date), then what it does once the answer is complete."""
        out = [httptools_impl.STATUS_LINE[status]]
        for name, value in headers:
            out += (name, b": ", value, b"\r\n")
        out.append(b"content-length: %d\r\n" % len(body))
        if not kept.keep_alive:
            out.append(b"connection: close\r\n")
        out += (b"\r\n", body)
        kept.response_started = kept.response_complete = True
        self.transport.write(b"".join(out))
        if not kept.keep_alive:
            self.transport.close()
        self.on_response_complete()

    def _promote(self, kept: _Kept, app: Any) -> None:
        """The kept request served by an ASGI call after all: the cycle uvicorn would have made
        at its head, holding what has come since, and its task."""
        cycle = RequestResponseCycle(
            scope=kept.scope,  # type: ignore[arg-type]
            transport=self.transport,
            flow=self.flow,
            logger=self.logger,
            access_logger=self.access_logger,
            access_log=self.access_log,
            default_headers=self.server_state.default_headers,
            message_event=asyncio.Event(),
            expect_100_continue=False,
            keep_alive=kept.keep_alive,
            on_response=self.on_response_complete,
        )
        cycle.body, cycle.more_body, cycle.disconnected = kept.body, kept.more_body, kept.disconnected
        cycle.message_event.set()  # what has come (all of it, or the disconnect) is there to read
        self.cycle = cycle
        self._start_asgi_task(cycle, app)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        kept = self.cycle
        if type(kept) is _Kept and not kept.response_complete:
            self._promote(kept, self.app)  # the app reads the disconnect and counts it, as ever

    def shutdown(self) -> None:
        kept = self.cycle
        if type(kept) is _Kept and not kept.response_complete:
            # In flight: its task, waiting for the body, is what the drain waits for and, at the
            # drain's end, cancels (a 500 and the connection closed).
            self._promote(kept, self.app)
        super().shutdown()


# --- uvicorn internals relied on (connection.check_uvicorn) ---

PROTOCOL_METHODS = ("on_headers_complete", "on_message_complete", "connection_lost", "shutdown", "_start_asgi_task")


def missing_internals() -> list[str]:
    """What this module uses of uvicorn that uvicorn no longer has."""
    missing = [a for a in PROTOCOL_METHODS if not hasattr(HttpToolsProtocol, a)]
    if not hasattr(httptools_impl, "STATUS_LINE"):
        missing.append("httptools_impl.STATUS_LINE")
    fields = set(HttpToolsProtocol.__init__.__code__.co_names) | set(
        HttpToolsProtocol.on_message_begin.__code__.co_names
    )
    used = ("app", "cycle", "flow", "logger", "access_logger", "access_log", "server_state", "root_path")
    missing += [
        f"HttpToolsProtocol.{a}" for a in (*used, "limit_concurrency", "expect_100_continue") if a not in fields
    ]
    cycle_fields = set(RequestResponseCycle.__init__.__code__.co_names)
    missing += [f"RequestResponseCycle.{a}" for a in _Kept.__slots__ if a != "name" and a not in cycle_fields]
    params = inspect.signature(RequestResponseCycle.__init__).parameters
    kwargs: tuple[str, ...] = ("scope", "transport", "flow", "logger", "access_logger", "access_log")
    kwargs += ("default_headers", "message_event", "expect_100_continue", "keep_alive", "on_response")
    missing += [f"RequestResponseCycle({a}=)" for a in kwargs if a not in params]
    return missing
