"""The control routes of the Open Inference Protocol over HTTP: every route but infer and generation.

Server and model metadata, health and readiness, statistics, model configuration, logging and
CUDA shared memory (Triton's extensions), /metrics, the model repository (index, load, unload),
and system shared memory registration. None is on the usual path of an infer request (its other
spellings, with a version or a trailing slash, reach the infer route through here), so a split of
the path routes them. Their bodies are small JSON documents parsed on the event loop, bounded by
CONTROL_BODY; only a load's, which may carry a model's files, is read up to server.max_body.
Where server.admin_group is set, only root and its members may load, unload or change the log
settings.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import Awaitable, Callable
from typing import Any, TypeGuard

import orjson

from edged.errors import BadRequestError, ForbiddenError, NotFoundError
from edged.repository.load_request import PLAIN, LoadRequest, from_parameters
from edged.serving.service import Service
from edged.serving.states import ModelState
from edged.transports.budget import BodyBudget
from edged.transports.http import triton
from edged.transports.http.body import read_body
from edged.transports.http.infer import JSON_HEADERS as _JSON
from edged.transports.http.infer import InferRoute
from edged.transports.http.methods import expect as _expect
from edged.transports.peer import PEER_KEY, Peer, in_group
from edged.transports.shm.regions import SharedMemoryRegistry
from edged.wire.decode import Part
from edged.wire.jsondoc import load_object

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Body = bytes | list[Part]

# The largest body a control route takes (log settings, shared memory registration, load/unload).
CONTROL_BODY = 64 * 1024


class ControlRoutes:
    """The answer of a request that is neither an infer request by its usual path nor one for
    the generation routes, made whole (the app compresses and sends it)."""

    def __init__(
        self,
        service: Service,
        shm: SharedMemoryRegistry,
        max_body: int,
        bodies: BodyBudget,
        infer: InferRoute,
        admin_gid: int | None,
    ) -> None:
        self.service = service
        self.shm = shm
        self.max_body = max_body
        self.bodies = bodies
        # The infer route, for its other spellings (a version, a trailing slash).
        self.infer = infer
        self.admin_gid = admin_gid  # server.admin_group's id; None lets anyone load, unload and log

    async def __call__(self, scope: Scope, receive: Receive) -> tuple[int, Body, list[tuple[bytes, bytes]]]:
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
        if parts[1:] == ["models", "stats"]:  # every model's statistics (Triton's reading, not a model "stats")
            _expect(method, "GET")
            return 200, triton.statistics(self.service, None), _JSON
        if len(parts) >= 3 and parts[1] == "models":
            return await self._models(method, parts[2], parts[3:], scope, receive)
        return await self._other(method, parts[1:], scope, receive)

    async def _read_small(self, scope: Scope, receive: Receive) -> bytes | memoryview:
        """The body of a control route (settings, registrations): a few hundred bytes, parsed on
        the loop, so bounded far below max_body (64 MiB of JSON took the loop for 1.25 s)."""
        return await read_body(scope, receive, CONTROL_BODY)

    async def _models(
        self, method: str, name: str, rest: list[str], scope: Scope, receive: Receive
    ) -> tuple[int, Body, list[tuple[bytes, bytes]]]:
        if len(rest) >= 2 and rest[0] == "versions":
            name = self.service.resolve(name, rest[1])
            rest = rest[2:]
        if rest == ["infer"]:
            _expect(method, "POST")
            return await self.infer(name, scope, receive)
        _expect(method, "GET")
        if not rest:
            return 200, orjson.dumps(self.service.model_metadata(name)), _JSON
        if rest == ["stats"]:
            return 200, triton.statistics(self.service, name), _JSON
        if rest == ["config"]:
            return 200, triton.model_config(self.service, name), _JSON
        if rest == ["ready"]:
            rt = self.service.model(name)
            ready = rt.state == ModelState.READY and not self.service.stopping
            doc = {"name": name, "ready": ready, "state": rt.state, "reason": rt.reason}
            return (200 if ready else 503), orjson.dumps(doc), _JSON
        raise NotFoundError(f"no route for {scope['path']}")

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
        allowed = triton.methods(parts)  # logging, CUDA shared memory
        if allowed:
            _expect(method, *allowed)
            if parts == ["logging"] and method == "POST":
                await self._check_admin(scope, "change the log settings")
            body = await self._read_small(scope, receive) if method == "POST" else b""
            verb = "GET" if method == "HEAD" else method  # HEAD answers what GET would, without the body
            return 200, triton.answer(verb, parts, body), _JSON
        if parts == ["edged", "status"]:
            _expect(method, "GET")
            return 200, orjson.dumps(svc.status()), _JSON
        raise NotFoundError(f"no route for {scope['path']}")

    async def _repository(
        self, method: str, parts: list[str], scope: Scope, receive: Receive
    ) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        _expect(method, "POST")
        if len(parts) == 3 and parts[0] == "models" and parts[2] in ("load", "unload"):
            await self._check_admin(scope, f"{parts[2]} models")
            if parts[2] == "load":
                await self.service.load(parts[1], await self._load_request(parts[1], scope, receive))
            else:
                await self._read_small(scope, receive)
                await self.service.unload(parts[1])
            return 200, b"{}", _JSON
        await self._read_small(scope, receive)
        if parts == ["index"]:
            return 200, orjson.dumps(self.service.repository_index()), _JSON
        raise NotFoundError(f"no route for {scope['path']}")

    async def _load_request(self, name: str, scope: Scope, receive: Receive) -> LoadRequest:
        """A load's body: its config and files (base64 in the JSON, as Triton's HTTP API has
        them), read up to max_body within the bodies' budget and decoded off the loop when large
        (files are refused by the service where server.model_uploads takes none, as on gRPC)."""
        body = await read_body(scope, receive, self.max_body, budget=self.bodies)
        if len(body) <= CONTROL_BODY:
            return _load_parameters(name, body)
        return await asyncio.to_thread(_load_parameters, name, body)

    async def _check_admin(self, scope: Scope, what: str) -> None:
        gid = self.admin_gid
        if gid is None:
            return
        peer: Peer | None = scope.get(PEER_KEY)
        if peer is not None and (peer.uid == 0 or peer.gid == gid):
            return
        # Supplementary groups come from the user and group databases, which NSS may answer
        # over the network (LDAP, sssd): looked up off the event loop.
        if peer is None or not await asyncio.to_thread(in_group, peer, gid):
            raise ForbiddenError(f"only root and members of server.admin_group may {what}")

    async def _shm(
        self, method: str, parts: list[str], scope: Scope, receive: Receive
    ) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        peer: Peer | None = scope.get(PEER_KEY)
        # Over TCP (no peer credentials) no region can be registered, so there is none to list or
        # to release: Triton's clients ask for both before they start, as for CUDA shared memory.
        if parts == ["status"]:
            _expect(method, "GET")
            return 200, orjson.dumps(self.shm.status_for(peer) if peer is not None else []), _JSON
        if parts == ["unregister"]:
            _expect(method, "POST")
            await self._read_small(scope, receive)
            if peer is not None:
                self.shm.unregister_for(peer)
            return 200, b"{}", _JSON
        if len(parts) == 3 and parts[0] == "region":
            name, action = parts[1], parts[2]
            if action == "status":
                _expect(method, "GET")
                return 200, orjson.dumps(self.shm.status_for(peer, name)), _JSON
            _expect(method, "POST")
            body = await self._read_small(scope, receive)
            if action == "register":
                self._register(peer, name, body)
                return 200, b"{}", _JSON
            if action == "unregister":
                if peer is not None:
                    self.shm.unregister_for(peer, name)
                return 200, b"{}", _JSON
        raise NotFoundError(f"no route for {scope['path']}")

    def _register(self, peer: Peer | None, name: str, body: bytes | memoryview) -> None:
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError as e:
            raise BadRequestError(f"malformed JSON: {e}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("key"), str):
            raise BadRequestError('register needs {"key": str, "offset": int, "byte_size": int}')
        offset, size = doc.get("offset", 0), doc.get("byte_size")
        if not _is_int(offset) or not _is_int(size):
            raise BadRequestError("'offset' and 'byte_size' must be integers")
        self.shm.register(peer, name, doc["key"], offset, size)


def _load_parameters(name: str, body: bytes | memoryview) -> LoadRequest:
    """A load request's body: empty, or ``{"parameters": {...}}`` with the config a JSON string
    and each ``file:PATH`` its contents in base64."""
    if not bytes(body).strip():
        return PLAIN
    doc = load_object(body, f"failed to load '{name}': the body must be a JSON object", f"failed to load '{name}'")
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise BadRequestError(f"failed to load '{name}': 'parameters' must be an object")
    values: dict[str, object] = {}
    for key, value in params.items():
        if key.startswith("file:") and isinstance(value, str):
            try:
                values[key] = base64.b64decode(value, validate=True)
            except binascii.Error as e:
                raise BadRequestError(f"failed to load '{name}': {key[:80]}: not base64: {e}") from None
        else:
            values[key] = value
    return from_parameters(name, values)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)
