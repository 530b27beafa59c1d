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

import functools
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import numpy as np

from edged.errors import EdgedError, ShuttingDownError
from edged.serving.registry import ModelRuntime
from edged.serving.service import Service, decode_now
from edged.transports.budget import BodyBudget
from edged.transports.http.body import BodyHeaders, body_headers, read_body
from edged.transports.peer import PEER_KEY
from edged.transports.shm.lazy import LazyShm, fill_inputs
from edged.transports.shm.regions import SharedMemoryRegistry
from edged.transports.shm.worker_reads import WorkerReads
from edged.wire.decode import InferRequest, Part, parse_header_length
from edged.wire.encode import OFFLOAD_BYTES, encode_large_async, encode_now

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Body = bytes | list[Part]
Headers = list[tuple[bytes, bytes]]
Answer = tuple[int, Body, Headers]
Rest = Callable[[], Awaitable[Answer]]  # the rest of an answer, made when it is called
Tensors = Mapping[str, np.ndarray]

JSON_HEADERS: Headers = [(b"content-type", b"application/json")]
_BINARY = b"application/octet-stream"
_PREFIX, _SUFFIX = "/v2/models/", "/infer"
# In the scope of a request the app took at its head to answer at once (App.wants): admitted
# then, it is served by a daemon that began to stop since, as one whose ASGI call began there.
ADMITTED = "edged.admitted"


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
    def __init__(
        self, service: Service, regions: SharedMemoryRegistry, max_body: int, bodies: BodyBudget | None = None
    ) -> None:
        self.service = service
        self.regions = regions
        self.max_body = max_body
        self.bodies = bodies
        self.accepting = True

    async def __call__(self, name: str, scope: Scope, receive: Receive) -> Answer:
        svc = self.service
        shm = LazyShm(self.regions, scope.get(PEER_KEY))
        try:
            try:
                if not (self.accepting or scope.get(ADMITTED)):
                    raise ShuttingDownError("edged is shutting down")
                svc.model(name)  # an unknown model is a 404 whatever the body holds
                headers = body_headers(scope)  # one pass over the headers for everything the route reads
                body = await read_body(scope, receive, self.max_body, headers, self.bodies)
                # The statistics' compute_input starts once the body is in, as Triton's does: a
                # slow upload is not the daemon's time.
                received = time.perf_counter_ns()
                header_len = _header_length(headers)
                rt = svc.model(name)  # again: a reload may have swapped it during the read
                plan = svc.plan_for(rt)
                if len(body) <= OFFLOAD_BYTES:
                    req = decode_now(plan, body, header_len, shm.input)
                else:
                    req = await svc.decode_infer(name, body, header_len, shm.input)
                # Anything awaited since the lookup (a decode off the loop, copies, BYTES to read)
                # may have let a reload replace the model: such a request goes by name.
                waited = len(body) > OFFLOAD_BYTES or shm.held is not None or bool(req.pending)
                # A frame for an idle worker is copied by that worker, right before its run.
                late = None if req.pending or shm.held is None or not _idle(rt) else shm.held.read_on_worker()
                if shm.held is not None or req.pending:
                    await fill_inputs(req, shm)
            except EdgedError as e:  # never reached the model: counted here (the service counts the rest)
                svc.metrics.reject(name, "http", e.code, known=name in svc.registry.models)
                raise
            # At once where it can (an inline model, the runtime and plan of this very moment).
            outputs = None if waited else svc.infer_now(rt, plan, req.inputs, req.id, "http", received, req.shapes)
            if outputs is None:
                outputs = await self._infer(name, req, shm, received, tried_now=not waited, source=late)
            answer = self._encode(name, req, outputs, shm, received)
            return answer if isinstance(answer, tuple) else await answer()
        finally:
            shm.release()

    async def _infer(
        self,
        name: str,
        req: InferRequest,
        shm: LazyShm,
        received: int,
        tried_now: bool,
        source: WorkerReads | None = None,
    ) -> dict[str, np.ndarray]:
        """``Service.infer``, with the outputs bound for shared memory written by the model's
        worker right after its run (or by the run itself: transports/shm/worker_writes.py), and
        the inputs of ``source`` copied by it right before."""
        early = shm.request().write_early(req.outputs) if req.outputs and _to_shm(req, OFFLOAD_BYTES) else None
        try:
            return await self.service.infer(
                name, req.inputs, req.id, received_ns=received, tried_now=tried_now, sink=early, source=source
            )
        except EdgedError:
            settled = None if early is None else early.settled()
            if settled is not None:
                await settled  # the run still writes into the region: answered once it is over
            raise

    def inline(self, name: str) -> bool:
        """Whether ``name`` is a model that runs inline, served now (what ``now`` answers)."""
        rt = self.service.registry.models.get(name)
        return self.accepting and rt is not None and rt.queue is not None and rt.queue.inline

    def now(self, name: str, scope: Scope, body: bytes) -> Answer | Rest | None:
        """The answer of a request whose whole body is in hand, made at once by the caller (the
        connection's parser callback: no task, no ASGI call) when nothing in it awaits but,
        perhaps, its encoding: a model that runs inline, tensors in the body, no shared memory,
        no Content-Encoding. When the encoding awaits (a large answer), the rest of it, to call
        and await. None, with nothing done or counted, for any other request: ``__call__``
        serves it, with the same checks and errors. Only for a request admitted at its head
        (``inline``): as in ``__call__``, a daemon that began to stop since then still serves it."""
        svc = self.service
        rt = svc.registry.models.get(name)
        queue = None if rt is None else rt.queue
        if queue is None or not queue.inline or len(body) > min(self.max_body, OFFLOAD_BYTES):
            return None
        assert rt is not None
        headers = body_headers(scope)
        if headers.encodings:
            return None
        received = time.perf_counter_ns()
        shm = LazyShm(self.regions, scope.get(PEER_KEY))
        try:
            try:
                plan = svc.plan_for(rt)
                req = decode_now(plan, body, _header_length(headers), shm.input)
            except EdgedError as e:
                svc.metrics.reject(name, "http", e.code, known=True)
                raise
            if shm.held is not None or req.pending or _to_shm(req):
                return None  # copies to or from shared memory, or BYTES to read: awaited
            outputs = svc.infer_now(rt, plan, req.inputs, req.id, "http", received, req.shapes)
            if outputs is None:
                return None
            return self._encode(name, req, outputs, shm, received)
        finally:
            shm.release()  # it holds nothing here: the rest of an answer never needs it

    def _encode(self, name: str, req: InferRequest, outputs: Tensors, shm: LazyShm, received: int) -> Answer | Rest:
        """The answer, at once when it is small and nothing is to be written to shared memory;
        else the rest of its encoding, to call and await (it releases ``shm``: the caller's
        release is then a no-op)."""
        ran = time.perf_counter_ns()
        model, version = self.service.versions().served(name)  # what the client asked for
        try:
            encoded: tuple[Body, int | None] | None = encode_now(model, req, outputs, shm.output, version)
        except BaseException:
            self.service.stats.encode_failed(name, received, ran)
            raise
        if encoded is None or (shm.held is not None and shm.held.writes):
            return functools.partial(self._encode_late, name, req, outputs, shm.take(), received, ran, encoded)
        self.service.stats.encoded(name, ran, shm.written_ns())
        return _answer(*encoded)

    async def _encode_late(
        self,
        name: str,
        req: InferRequest,
        outputs: Tensors,
        shm: LazyShm,
        received: int,
        ran: int,
        encoded: tuple[Body, int | None] | None,
    ) -> Answer:
        try:
            try:
                served = self.service.versions().served(name)
                answer, header_len = encoded or await _encode_large(served, req, outputs, shm)
                if shm.held is not None and shm.held.writes:
                    await shm.held.flush()
            except BaseException:
                self.service.stats.encode_failed(name, received, ran)
                raise
            self.service.stats.encoded(name, ran, shm.written_ns())
            return _answer(answer, header_len)
        finally:
            shm.release()


def _to_shm(req: InferRequest, above: int = -1) -> bool:
    """Whether an output goes to shared memory with more than ``above`` bytes (the size the
    request gave it). The worker writes only those above OFFLOAD_BYTES: a smaller one is copied on
    the loop as it is encoded, for less than the worker's bookkeeping costs (conv640's 40-byte
    answer in a region took 0.1 ms more end to end when the worker wrote it, 2-core machine and
    16-core host)."""
    return req.outputs is not None and any(o.shm_region is not None and o.shm_size > above for o in req.outputs)


def _idle(rt: ModelRuntime) -> bool:
    """Whether the model has a worker free to copy a request's inputs itself: a busy one leaves
    them to a copier thread, whose copy then overlaps the run ahead of it."""
    return rt.queue is not None and rt.queue.idle


def _header_length(headers: BodyHeaders) -> int | None:
    header_len = None
    for value in headers.header_lengths:  # each one checked, the last one used
        header_len = parse_header_length(value, "Inference-Header-Content-Length")
    return header_len


# A model's binary answers have the same header length, so the same response headers: made once.
_binary_headers: dict[int, Headers] = {}
_BINARY_HEADERS_KEPT = 256


def _answer(body: Body, header_len: int | None) -> Answer:
    if header_len is None:
        return 200, body, JSON_HEADERS
    headers = _binary_headers.get(header_len)
    if headers is None:
        if len(_binary_headers) >= _BINARY_HEADERS_KEPT:
            _binary_headers.clear()
        headers = _binary_headers[header_len] = [
            (b"content-type", _BINARY),
            (b"inference-header-content-length", str(header_len).encode()),
        ]
    return 200, body, headers


async def _encode_large(
    served: tuple[str, str], req: InferRequest, outputs: Tensors, shm: LazyShm
) -> tuple[Body, int | None]:
    early = None if shm.held is None else shm.held.early
    written = early is not None and early.complete
    model, version = served
    parts, header_len = await encode_large_async(model, req, outputs, shm.output, written, version)
    first = parts[0]
    return (first if len(parts) == 1 and isinstance(first, bytes) else parts), header_len
