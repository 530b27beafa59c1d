"""The infer route of the HTTP transport: one request, from its body to its answer.

Every infer request takes this one path. Its usual case, a body and an answer of at most
OFFLOAD_BYTES and no shared memory, runs straight through: decoded and encoded on the loop,
answered at once by a model that runs inline (``ModelQueue.run_now``). The other cases await the
async forms of the same steps (decoding or encoding on a worker thread, copies to and from
shared memory, a queued model). It is kept flat on purpose: the layers of calls it replaced
(routing, the shared-memory request object, the service's and scheduler's coroutines, a second
plan lookup) cost a tiny model's request more than its run (docs/performance.md).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import numpy as np

from edged.encoding import OFFLOAD_BYTES, encode_large_async, encode_now
from edged.errors import EdgedError, ShuttingDownError
from edged.protocol import InferRequest, Part, ShmResolver, parse_header_length, resolve_pending_async
from edged.service import Service, decode_now
from edged.transports.http_body import body_headers, read_body
from edged.transports.peer import PEER_KEY, Peer
from edged.transports.shm import SharedMemoryRegistry
from edged.transports.shm_io import ShmRequest

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Body = bytes | list[Part]
Headers = list[tuple[bytes, bytes]]
Answer = tuple[int, Body, Headers]
Tensors = Mapping[str, np.ndarray]

JSON_HEADERS: Headers = [(b"content-type", b"application/json")]
_BINARY = b"application/octet-stream"
_PREFIX, _SUFFIX = "/v2/models/", "/infer"


def infer_target(path: str) -> str | None:
    """The model of ``/v2/models/{name}/infer``, the route nearly every request takes, found
    without splitting the path; None for any other path (routed in full, which reaches the same
    route for its other spellings: a version, a trailing slash)."""
    if path.startswith(_PREFIX) and path.endswith(_SUFFIX):
        name = path[len(_PREFIX) : -len(_SUFFIX)]
        if name and "/" not in name:
            return name
    return None


class InferRoute:
    def __init__(self, service: Service, regions: SharedMemoryRegistry, max_body: int) -> None:
        self.service = service
        self.regions = regions
        self.max_body = max_body
        self.accepting = True

    async def __call__(self, name: str, scope: Scope, receive: Receive) -> Answer:
        svc = self.service
        shm = _LazyShm(self.regions, scope.get(PEER_KEY))
        try:
            try:
                if not self.accepting:
                    raise ShuttingDownError("edged is shutting down")
                svc.model(name)  # an unknown model is a 404 whatever the body holds
                headers = body_headers(scope)  # one pass over the headers for everything the route reads
                body = await read_body(scope, receive, self.max_body, headers)
                # The statistics' compute_input starts once the body is in, as Triton's does: a
                # slow upload is not the daemon's time.
                received = time.perf_counter_ns()
                header_len = None
                for value in headers.header_lengths:
                    header_len = parse_header_length(value, "Inference-Header-Content-Length")
                rt = svc.model(name)  # again: a reload may have swapped it during the read
                plan = svc.plan_for(rt)
                if len(body) <= OFFLOAD_BYTES:
                    req = decode_now(plan, body, header_len, shm.input)
                else:
                    req = await svc.decode_infer(name, body, header_len, shm.input)
                # Anything awaited since the lookup (a decode off the loop, copies, BYTES to read)
                # may have let a reload replace the model: such a request goes by name.
                waited = len(body) > OFFLOAD_BYTES or shm.held is not None or bool(req.pending)
                if shm.held is not None or req.pending:
                    await _fill(req, shm)
            except EdgedError as e:  # never reached the model: counted here (the service counts the rest)
                svc.metrics.reject(name, "http", e.code, known=name in svc.registry.models)
                raise
            # At once where it can (an inline model, the runtime and plan of this very moment).
            outputs = None if waited else svc.infer_now(rt, plan, req.inputs, req.id, "http", received)
            if outputs is None:
                outputs = await svc.infer(name, req.inputs, req.id, received_ns=received, tried_now=not waited)
            ran = time.perf_counter_ns()
            try:
                encoded: tuple[Body, int | None] | None = encode_now(name, req, outputs, shm.output)  # the usual
                answer, header_len = encoded or await _encode_large(name, req, outputs, shm.output)
                if shm.held is not None and shm.held.writes:
                    await shm.held.flush()
            except BaseException:
                svc.stats.encode_failed(name, received, ran)
                raise
            svc.stats.encoded(name, ran)
        finally:
            shm.release()
        if header_len is None:
            return 200, answer, JSON_HEADERS
        return 200, answer, [(b"content-type", _BINARY), (b"inference-header-content-length", str(header_len).encode())]


async def _fill(req: InferRequest, shm: _LazyShm) -> None:
    if shm.held is not None and shm.held.reads:
        await shm.held.fill()  # inputs are copied out of client memory before the model sees them
    if req.pending:  # BYTES inputs are read once their bytes are copied (or, mapped, at once)
        await resolve_pending_async(req)


async def _encode_large(name: str, req: InferRequest, outputs: Tensors, shm: ShmResolver) -> tuple[Body, int | None]:
    parts, header_len = await encode_large_async(name, req, outputs, shm)
    first = parts[0]
    return (first if len(parts) == 1 and isinstance(first, bytes) else parts), header_len


class _LazyShm:
    """The request's ShmRequest, made only when the request names a region (few do)."""

    __slots__ = ("held", "peer", "regions")
    held: ShmRequest | None

    def __init__(self, regions: SharedMemoryRegistry, peer: Peer | None) -> None:
        self.regions, self.peer, self.held = regions, peer, None

    def request(self) -> ShmRequest:
        if self.held is None:
            self.held = ShmRequest(self.regions.region_for(self.peer), self.peer)
        return self.held

    def input(self, name: str, offset: int, size: int) -> memoryview:
        return self.request().input(name, offset, size)

    def output(self, name: str, offset: int, size: int) -> memoryview:
        return self.request().output(name, offset, size)

    def release(self) -> None:
        if self.held is not None:
            self.held.release()
