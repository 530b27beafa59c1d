"""The Open Inference Protocol (KServe v2) over HTTP/1.1 on the Unix socket.

A raw ASGI callable served by uvicorn (httptools parser, uvloop): the fastest well-kept stack
measured on a small board (design section 2), with socket activation and graceful drain. Routing
is a split of the path, not a framework, because the infer route is on every request's path.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from edged.config import parse_size
from edged.errors import ConfigError, EdgedError, NotFoundError, UnauthorizedError
from edged.serving.metrics import uncounted
from edged.serving.service import Service
from edged.transports.budget import BodyBudget
from edged.transports.http import openai
from edged.transports.http.body import accepted_encoding, compress
from edged.transports.http.control import ControlRoutes
from edged.transports.http.infer import ADMITTED, InferRoute, Rest, infer_target
from edged.transports.http.infer import JSON_HEADERS as _JSON
from edged.transports.http.methods import error_body, error_headers
from edged.transports.peer import ACCESS_KEY, PEER_KEY, ListenerAccess, Peer, health_or_metrics, token_matches
from edged.transports.shm.regions import SharedMemoryRegistry
from edged.wire.decode import Part

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Body = bytes | list[Part]
Headers = list[tuple[bytes, bytes]]
Answer = tuple[int, Body, Headers]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class App:
    def __init__(self, service: Service, shm: SharedMemoryRegistry, max_body: int) -> None:
        self.service = service
        self.shm = shm
        self.max_body = max_body
        server = service.registry.cfg.server
        # One budget for every body in flight, whichever route reads it.
        self.bodies = BodyBudget(max(parse_size(server.bodies_in_flight), max_body))
        self.infer = InferRoute(service, shm, max_body, self.bodies)
        self.admin_gid = _group_id(server.admin_group) if server.admin_group else None
        self.control = ControlRoutes(service, shm, max_body, self.bodies, self.infer, self.admin_gid)
        self.generation = openai.GenerationRoutes(service, max_body, self.bodies)
        # Answers at least this large are compressed for clients that accept gzip or deflate.
        self.compress_min = parse_size(server.compress_min_size)

    @property
    def accepting(self) -> bool:
        return self.infer.accepting

    @accepting.setter
    def accepting(self, value: bool) -> None:  # False once the daemon stops: new requests are refused
        self.infer.accepting = self.generation.accepting = value

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # lifespan is off; websockets are not served
        if self.service.warming and _own(scope.get(PEER_KEY)):
            with uncounted():  # the daemon's warm-up through its own socket is not traffic
                await self._serve(scope, receive, send)
            return
        await self._serve(scope, receive, send)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        answer = await self._answered(scope, self._route(scope, receive, send))
        if answer is not None:
            await _send(send, *answer)

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> Answer | None:
        """The request's answer; None from the generation routes, which stream (they own send)."""
        access: ListenerAccess | None = scope.get(ACCESS_KEY)
        if access is not None:
            _check_access(access, scope)
        path = scope["path"]
        name = infer_target(path) if scope["method"] == "POST" else None
        if name is not None:  # nearly every request: no routing beyond this
            return await self.infer(name, scope, receive)
        if openai.handles(path):  # language models: they stream, so they own send
            await self.generation(scope, receive, send)  # answers its own errors
            return None
        return await self.control(scope, receive)

    async def _answered(self, scope: Scope, work: Awaitable[Answer | None]) -> Answer | None:
        """``work``'s answer, compressed where the client asks for it, or the answer of its error."""
        try:
            answer = await work
            if answer is None:
                return None
            status, body, headers = answer
            if not self._as_is(answer):
                body, headers = await self._encode(scope, body, headers)
            return status, body, headers
        except EdgedError as e:
            return _error(e, scope["path"])
        except Exception as e:  # a bug must answer 500, never drop the connection silently
            return _internal(scope, e)

    def wants(self, scope: Scope) -> str | None:
        """The model of a request ``now`` may answer, from its head alone (the connection then
        keeps its body until it is whole, rather than starting the ASGI call at once): an infer
        request to a model that runs inline, let in by its listener. None for any other."""
        if scope["method"] != "POST":
            return None
        name = infer_target(scope["path"])
        if name is None or not self.infer.inline(name):
            return None  # an unknown model, say, is answered before its body, as ever
        access: ListenerAccess | None = scope.get(ACCESS_KEY)
        try:
            if access is not None:
                _check_access(access, scope)
        except EdgedError:
            return None  # refused at once by __call__
        scope[ADMITTED] = True  # also when the ASGI call serves it after all (a decline, a stop)
        return name

    def now(self, scope: Scope, body: bytes, name: str) -> Answer | ASGIApp | None:
        """The answer of a request whose whole body is in hand, made at once on the connection's
        parser callback (connection.py), for a request ``wants`` took (``name``: its answer).
        Where only the answer's encoding or compression awaits, an ASGI app that finishes it.
        None, with nothing done, where the route declines (served through ``__call__``)."""
        if self.service.warming and _own(scope.get(PEER_KEY)):
            with uncounted():  # the daemon's warm-up through its own socket is not traffic
                answer = self._now(scope, body, name)
            return answer if answer is None or isinstance(answer, tuple) else functools.partial(_uncounted, answer)
        return self._now(scope, body, name)

    def _now(self, scope: Scope, body: bytes, name: str) -> Answer | ASGIApp | None:
        try:
            answer = self.infer.now(name, scope, body)
        except EdgedError as e:
            return _error(e)
        except Exception as e:  # a bug must answer 500, never drop the connection silently
            return _internal(scope, e)
        if answer is None:
            return None
        if isinstance(answer, tuple) and self._as_is(answer):
            return answer
        return functools.partial(self._finish, answer)

    def _as_is(self, answer: Answer) -> bool:
        """An answer sent as it is: an error, or a body too small to compress (``_encode``)."""
        status, body, _ = answer
        return status != 200 or (isinstance(body, bytes) and len(body) < self.compress_min)

    async def _finish(self, answer: Answer | Rest, scope: Scope, receive: Receive, send: Send) -> None:
        """The rest of an answer ``now`` began: encoded or compressed, then sent (an ASGI app)."""
        done = await self._answered(scope, _ready(answer) if isinstance(answer, tuple) else answer())
        assert done is not None
        await _send(send, *done)

    async def _encode(
        self, scope: Scope, body: Body, headers: list[tuple[bytes, bytes]]
    ) -> tuple[Body, list[tuple[bytes, bytes]]]:
        """``body`` compressed when the client accepts it and it is at least server.compress_min_size
        (the uncompressed size: Inference-Header-Content-Length keeps counting uncompressed bytes).
        The caller skips this for the common small answer."""
        parts: list[Part] = body if isinstance(body, list) else [body]
        size = sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in parts)
        if size < self.compress_min:
            return body, headers
        encoding = accepted_encoding(scope)
        vary = (b"vary", b"accept-encoding")
        if encoding is None:
            return body, [*headers, vary]
        packed = await compress(parts, size, encoding)
        if sum(len(p) for p in packed) >= size:  # incompressible (random or packed tensors): sent as is
            return body, [*headers, vary]
        out: list[Part] = [*packed]
        return out, [*headers, (b"content-encoding", encoding.encode()), vary]


def _check_access(access: ListenerAccess, scope: Scope) -> None:
    """What the listener the request came through lets in (listener.py)."""
    if not token_matches(scope["headers"], access.token):
        raise UnauthorizedError("this listener needs 'Authorization: Bearer <token>' (server.tcp_token_file)")
    if access.metrics_only and not health_or_metrics(scope["path"]):
        raise NotFoundError(f"{access.label} serves only /metrics and /v2/health")


def _group_id(name: str) -> int:
    import grp

    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise ConfigError(f"server.admin_group: no group named '{name}' on this system") from None


def _own(peer: Peer | None) -> bool:
    """A connection from the daemon itself (its warm-up of the socket path)."""
    return peer is not None and peer.pid == os.getpid()


async def _uncounted(app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
    with uncounted():
        await app(scope, receive, send)


async def _ready(answer: Answer) -> Answer:
    return answer


def _error(e: EdgedError, path: str = "") -> Answer:
    headers = error_headers(e, _JSON)
    if e.http_status == 401:
        headers = [*_JSON, (b"www-authenticate", b"Bearer")]
    return e.http_status, error_body(e.code, e.message, path), headers


def _internal(scope: Scope, e: Exception) -> Answer:
    log.exception("unhandled error on %s", scope.get("path"), exc_info=e)
    return 500, orjson.dumps({"error": str(e), "code": "internal"}), _JSON


async def _send(send: Send, status: int, body: Body, headers: Headers) -> None:
    if isinstance(body, list):  # a large infer response, in parts
        length = sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in body)
        await send({"type": "http.response.start", "status": status, "headers": [*headers, _length(length)]})
        for i, part in enumerate(body):
            await send({"type": "http.response.body", "body": part, "more_body": i + 1 < len(body)})
        return
    await send({"type": "http.response.start", "status": status, "headers": [*headers, _length(len(body))]})
    await send({"type": "http.response.body", "body": body})


def _length(n: int) -> tuple[bytes, bytes]:
    return (b"content-length", str(n).encode())
