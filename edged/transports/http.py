"""The Open Inference Protocol (KServe v2) over HTTP/1.1 on the Unix socket.

A raw ASGI callable served by uvicorn (httptools parser, uvloop): the fastest well-kept stack
measured on a small board (design section 2), with socket activation and graceful drain. Routing
is a split of the path, not a framework, because the infer route is on every request's path.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from edged.errors import (
    BadRequestError,
    EdgedError,
    NotFoundError,
    PayloadTooLargeError,
    ShuttingDownError,
)
from edged.protocol import InferRequest, decode_infer, encode_infer
from edged.service import Service
from edged.transports import openai_api
from edged.transports.shm import SharedMemoryRegistry

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_JSON = [(b"content-type", b"application/json")]
_BINARY = b"application/octet-stream"


class HttpError(EdgedError):
    """Routing errors that belong to HTTP alone (405)."""

    code = "method_not_allowed"
    http_status = 405


class App:
    def __init__(self, service: Service, shm: SharedMemoryRegistry, max_body: int) -> None:
        self.service = service
        self.shm = shm
        self.max_body = max_body
        self.accepting = True
        self.generation = openai_api.GenerationRoutes(service, max_body)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # lifespan is off; websockets are not served
        if openai_api.handles(scope["path"]):  # language models: they stream, so they own send
            self.generation.accepting = self.accepting
            await self.generation(scope, receive, send)
            return
        try:
            status, body, headers = await self._dispatch(scope, receive)
        except EdgedError as e:
            status, body, headers = e.http_status, orjson.dumps(e.to_dict()), _JSON
        except Exception as e:  # a bug must answer 500, never drop the connection silently
            log.exception("unhandled error on %s", scope.get("path"))
            status, body, headers = 500, orjson.dumps({"error": str(e), "code": "internal"}), _JSON
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        for key, value in scope["headers"]:
            if key == b"content-length" and int(value) > self.max_body:
                raise PayloadTooLargeError(f"body of {int(value)} bytes exceeds the limit of {self.max_body}")
        message = await receive()
        body: bytes = message.get("body", b"")
        if not message.get("more_body"):
            return body  # the common case: one message, no copy
        parts = [body]
        size = len(body)
        while message.get("more_body"):
            message = await receive()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise PayloadTooLargeError(f"body exceeds the limit of {self.max_body} bytes")
            parts.append(chunk)
        return b"".join(parts)

    async def _dispatch(self, scope: Scope, receive: Receive) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        path = scope["path"]
        method = scope["method"]
        parts = path.strip("/").split("/")
        if parts[0] == "metrics" and len(parts) == 1:
            _expect(method, "GET")
            # Off the loop: formatting a few hundred samples takes milliseconds.
            body = await asyncio.to_thread(self.service.metrics.render)
            return 200, body, [(b"content-type", b"text/plain; version=0.0.4")]
        if parts[0] != "v2":
            raise NotFoundError(f"no route for {path}")
        if len(parts) >= 3 and parts[1] == "models":
            return await self._models(method, parts[2], parts[3:], scope, receive)
        return await self._other(method, parts[1:], scope, receive)

    async def _models(
        self, method: str, name: str, rest: list[str], scope: Scope, receive: Receive
    ) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        if len(rest) >= 2 and rest[0] == "versions":
            rest = rest[2:]  # one version per model: any version names it
        if rest == ["infer"]:
            _expect(method, "POST")
            return await self._infer(name, scope, receive)
        _expect(method, "GET")
        if not rest:
            return 200, orjson.dumps(self.service.model_metadata(name)), _JSON
        if rest == ["ready"]:
            rt = self.service.model(name)
            ready = rt.state == "ready" and not self.service.stopping
            doc = {"name": name, "ready": ready, "state": rt.state, "reason": rt.reason}
            return (200 if ready else 503), orjson.dumps(doc), _JSON
        raise NotFoundError(f"no route for {scope['path']}")

    async def _infer(self, name: str, scope: Scope, receive: Receive) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        try:
            req = await self._infer_request(name, scope, receive)
        except EdgedError as e:  # never reached the model: counted here (service.infer counts the rest)
            self.service.metrics.reject(name, "http", e.code)
            raise
        outputs = await self.service.infer(name, req.inputs, req.id)
        out, out_header_len = encode_infer(name, req, outputs, self.shm.resolve)
        if out_header_len is None:
            return 200, out, _JSON
        return (
            200,
            out,
            [(b"content-type", _BINARY), (b"inference-header-content-length", str(out_header_len).encode())],
        )

    async def _infer_request(self, name: str, scope: Scope, receive: Receive) -> InferRequest:
        if not self.accepting:
            raise ShuttingDownError("edged is shutting down")
        self.service.model(name)  # an unknown model is a 404 whatever the body holds
        body = await self._read_body(scope, receive)
        header_len = None
        for key, value in scope["headers"]:
            if key == b"inference-header-content-length":
                try:
                    header_len = int(value)
                except ValueError:
                    raise BadRequestError("Inference-Header-Content-Length must be an integer") from None
        return decode_infer(body, header_len, self.shm.resolve)

    async def _other(
        self, method: str, parts: list[str], scope: Scope, receive: Receive
    ) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        svc = self.service
        if not parts or parts == [""]:
            _expect(method, "GET")
            return 200, orjson.dumps(svc.server_metadata()), _JSON
        if parts[0] == "health" and len(parts) == 2 and parts[1] in ("live", "ready"):
            _expect(method, "GET")
            if parts[1] == "live":
                return 200, orjson.dumps({"live": True}), _JSON
            ready = svc.is_ready()
            return (200 if ready else 503), orjson.dumps({"ready": ready, "status": svc.status_line}), _JSON
        if parts[0] == "repository":
            return await self._repository(method, parts[1:], scope, receive)
        if parts[0] == "systemsharedmemory":
            return await self._shm(method, parts[1:], scope, receive)
        if parts == ["edged", "status"]:
            _expect(method, "GET")
            return 200, orjson.dumps(svc.status()), _JSON
        raise NotFoundError(f"no route for {scope['path']}")

    async def _repository(
        self, method: str, parts: list[str], scope: Scope, receive: Receive
    ) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        _expect(method, "POST")
        await self._read_body(scope, receive)  # load/unload parameters are not used
        if parts == ["index"]:
            return 200, orjson.dumps(self.service.repository_index()), _JSON
        if len(parts) == 3 and parts[0] == "models" and parts[2] in ("load", "unload"):
            if parts[2] == "load":
                await self.service.load(parts[1])
            else:
                await self.service.unload(parts[1])
            return 200, b"{}", _JSON
        raise NotFoundError(f"no route for {scope['path']}")

    async def _shm(
        self, method: str, parts: list[str], scope: Scope, receive: Receive
    ) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        if parts == ["status"]:
            _expect(method, "GET")
            return 200, orjson.dumps(self.shm.status()), _JSON
        if parts == ["unregister"]:
            _expect(method, "POST")
            self.shm.unregister()
            return 200, b"{}", _JSON
        if len(parts) == 3 and parts[0] == "region":
            name, action = parts[1], parts[2]
            if action == "status":
                _expect(method, "GET")
                return 200, orjson.dumps(self.shm.status(name)), _JSON
            _expect(method, "POST")
            body = await self._read_body(scope, receive)
            if action == "register":
                self._register(name, body)
                return 200, b"{}", _JSON
            if action == "unregister":
                self.shm.unregister(name)
                return 200, b"{}", _JSON
        raise NotFoundError(f"no route for {scope['path']}")

    def _register(self, name: str, body: bytes) -> None:
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError as e:
            raise BadRequestError(f"malformed JSON: {e}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("key"), str):
            raise BadRequestError('register needs {"key": str, "offset": int, "byte_size": int}')
        offset, size = doc.get("offset", 0), doc.get("byte_size")
        if not isinstance(offset, int) or not isinstance(size, int):
            raise BadRequestError("'offset' and 'byte_size' must be integers")
        self.shm.register(name, doc["key"], offset, size)


def _expect(method: str, allowed: str) -> None:
    if method != allowed:
        raise HttpError(f"method {method} is not allowed here; use {allowed}")
