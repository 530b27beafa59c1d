"""ModelInfer and ModelStreamInfer: one request, from its message to its answer.

The same steps as HTTP's infer route (transports/http/infer.py): the model resolved first, the
message decoded by the shared decoder (wire/kserve.py into wire/decode.py), shared memory
through the same holder (transports/shm/lazy.py), ``Service.infer`` for the run, statistics and
metrics under the transport "grpc". A stream carries at most ``server.grpc_stream_requests``
requests; a language model's request streams one response per piece of text, then a final one
with ``triton_final_response`` (decoupled, as Triton's vLLM and TensorRT-LLM backends answer);
any other model answers each request once. A response the peer does not take within
``server.grpc_write_timeout_s`` ends the stream.

Nothing whose cost grows with a message runs on the event loop. A request is read at the wire
where it can be (request.py, wire/kserve_wire.py: its raw contents are views of the bytes grpcio
handed over, and a request whose input and output records were planned before is decoded without
protobuf); any other is parsed by protobuf, which copies a bytes field on every access, so its raw
contents are taken from the message once. Either happens on a thread for a large message, and a message's
size is the length of its bytes. A large message that is not decoded by its client's plan (typed
contents, a language model's prompt) is decoded on a thread too, and a large answer is encoded
and serialized on one: the inference RPCs hand grpcio their answers as bytes (server.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import numpy as np

from edged.errors import (
    BadRequestError,
    EdgedError,
    PayloadTooLargeError,
    ShuttingDownError,
    StreamLimitError,
    StreamStalledError,
)
from edged.llm import generation as gen
from edged.ratelog import RateLimitedLog
from edged.serving.modelplan import ModelPlan, outputs_checked
from edged.serving.runtime import ModelRuntime
from edged.serving.service import Service
from edged.transports.grpc.access import Access
from edged.transports.grpc.request import Parsed
from edged.transports.peer import Peer
from edged.transports.shm.lazy import LazyShm, fill_inputs
from edged.transports.shm.regions import SharedMemoryRegistry
from edged.wire.decode import decode_document
from edged.wire.encode import OFFLOAD_BYTES
from edged.wire.kserve import (
    request_document,
    response_parts,
    serialized_answer,
    set_parameter,
)
from edged.wire.kserve_wire import answer as wire_answer
from edged.wire.kserve_wire import planned as wire_planned
from edged.wire.proto import grpc_service_pb2 as pb
from edged.wire.tensors import InferRequest, serialize_bytes
from edged.wire.validate import DEFAULT_LIMITS, Limits, check_counts

log = logging.getLogger(__name__)
_stalls = RateLimitedLog(log)  # a client can cause them: one line per interval, with a count

Ctx = Any  # grpc.aio.ServicerContext (grpcio ships no type information)
_TRANSPORT = "grpc"
# The model a request names (its served name), its runtime and its plan.
_LookedUp = tuple[str, ModelRuntime, ModelPlan]


class Inference:
    def __init__(
        self,
        service: Service,
        regions: SharedMemoryRegistry,
        access: Access,
        stream_requests: int,
        write_s: float,
        max_body: int,
    ) -> None:
        self.service, self.regions, self.access = service, regions, access
        # Closes the connection of a call's peer, and names it for the logs (the relay's, peers.py).
        self.cut: Callable[[str], bool] = lambda peer: False
        self.label: Callable[[str], str] = lambda peer: peer
        self.max_body = max_body
        self.stream_requests, self.write_s = stream_requests, write_s
        self.accepting = True

    async def ModelInfer(self, data: bytes, ctx: Ctx) -> bytes:
        # parsed_off_loop written out: one coroutine fewer on the way of every call.
        p = self.parsed(data) if len(data) <= OFFLOAD_BYTES else await asyncio.to_thread(self.parsed, data)
        return await self.one(p, self.access.check(ctx), stream=False)

    async def parsed_off_loop(self, data: bytes) -> Parsed:
        """``parsed``, on a thread for a message above OFFLOAD_BYTES."""
        if len(data) <= OFFLOAD_BYTES:
            return self.parsed(data)
        return await asyncio.to_thread(self.parsed, data)

    def parsed(self, data: bytes) -> Parsed:
        """The message grpcio hands over as bytes (server.py): read here, so that one over
        server.max_body or one that is not a ModelInferRequest gets edged's code and words."""
        if len(data) > self.max_body:
            raise PayloadTooLargeError(
                f"the message of {len(data)} bytes exceeds the limit of {self.max_body} (server.max_body)"
            )
        return Parsed.read(data)

    async def one(self, p: Parsed, peer: Peer | None, stream: bool) -> bytes:
        """The answer to one request, serialized: a ModelInferResponse, or a
        ModelStreamInferResponse holding it when ``stream``."""
        svc = self.service
        shm = LazyShm(self.regions, peer)
        name = p.name
        try:
            req, received, looked_up = await self._decode(p, shm)
            # At once where nothing was awaited since the lookup (as HTTP's route does): the
            # decoder's plan (req.shapes) then spares the model's check of the same shapes.
            outputs = None
            if looked_up is not None:
                name, rt, plan = looked_up
                outputs = svc.infer_now(rt, plan, req.inputs, req.id, _TRANSPORT, received, req.shapes)
            else:
                name = svc.resolve(p.name, p.version)  # again: the model may have gone meanwhile
            if outputs is None:
                tried = looked_up is not None
                outputs = await svc.infer(name, req.inputs, req.id, _TRANSPORT, received, tried_now=tried)
            ran = time.perf_counter_ns()
            model, version = svc.versions().served(name)
            try:
                answer = await self._encoded(model, version, req, outputs, shm, stream)
                if shm.held is not None and shm.held.writes:
                    await shm.held.flush()
            except BaseException:
                svc.stats.encode_failed(name, received, ran)
                raise
            svc.stats.encoded(name, ran)
            return answer
        finally:
            shm.release()

    async def _encoded(
        self,
        model: str,
        version: str,
        req: InferRequest,
        outputs: Mapping[str, np.ndarray],
        shm: LazyShm,
        stream: bool,
    ) -> bytes:
        """The answer's bytes: made on a thread when the outputs it carries are large (those
        bound for shared memory are resolved on the loop, which owns the regions, and carry
        nothing in the message)."""
        to_shm = req.outputs is not None and any(o.shm_region is not None for o in req.outputs)
        if to_shm:
            resp, raws = response_parts(model, version, req, outputs, shm.output)  # views: no copy
            if sum(r.nbytes if isinstance(r, memoryview) else len(r) for r in raws) <= OFFLOAD_BYTES:
                return serialized_answer(resp, raws, stream)
            return await asyncio.to_thread(serialized_answer, resp, raws, stream)
        if sum(a.nbytes for a in outputs.values()) <= OFFLOAD_BYTES:
            return wire_answer(model, version, req, outputs, stream) or serialized_answer(
                *response_parts(model, version, req, outputs), stream
            )

        def made() -> bytes:
            return wire_answer(model, version, req, outputs, stream) or serialized_answer(
                *response_parts(model, version, req, outputs), stream
            )

        return await asyncio.to_thread(made)

    async def _decode(self, p: Parsed, shm: LazyShm) -> tuple[InferRequest, int, _LookedUp | None]:
        """The request's inputs, ready for the model, when it was taken (perf_counter_ns), and
        the model it names with its plan where nothing was awaited since they were looked up
        (None where something was: they are looked up again)."""
        svc = self.service
        name = p.name
        try:
            if not self.accepting:
                raise ShuttingDownError("edged is shutting down")
            name = svc.resolve(p.name, p.version)
            received = time.perf_counter_ns()
            rt = svc.model(name)
            plan = svc.plan_for(rt)
            _check_size(p, plan.limits.json_bytes)
            # Before anything walks the tensor lists (the plan's key, the document): a message of
            # a million empty input headers is 4 MiB, and walking it held the loop for 1.5 s.
            check_counts(p.inputs, p.outputs, plan.limits)
            planned = None
            if p.wire is not None:
                planned = wire_planned(p.wire, p.message, shm.input, plan.limits, _document, p.plan)
            waited = False
            if planned is not None:
                req = planned
            elif p.large:
                req = await asyncio.to_thread(_decoded, p, shm.input, plan.limits)
                waited = True
            else:
                req = _decoded(p, shm.input, plan.limits)
            outputs_checked(plan, req)
            if shm.held is not None or req.pending:
                await fill_inputs(req, shm)
                waited = True
        except EdgedError as e:  # never reached the model: counted here (the service counts the rest)
            svc.metrics.reject(name, _TRANSPORT, e.code, known=name in svc.registry.models)
            raise
        return req, received, None if waited else (name, rt, plan)

    # --- streams ---

    async def ModelStreamInfer(self, requests: AsyncIterator[bytes], ctx: Ctx) -> None:
        """Written with ``context.write`` (not yielded) so that each write has its time-out."""
        peer = self.access.check(ctx)
        count = 0
        async for data in requests:
            count += 1
            if count > self.stream_requests:
                raise StreamLimitError(
                    f"a stream carries at most {self.stream_requests} requests "
                    "(server.grpc_stream_requests): open a new stream"
                )
            try:
                p = await self.parsed_off_loop(data)
                if self._generates(p.name):
                    await self._generate(p, ctx)
                else:
                    await self._write(ctx, await self.one(p, peer, stream=True))
            except StreamStalledError:
                raise
            except EdgedError as e:  # one request's error: the stream goes on, as Triton's does
                await self._write(ctx, _streamed_error(e.message))

    async def _write(self, ctx: Ctx, resp: bytes) -> None:
        """``resp`` (a serialized ModelStreamInferResponse) written within
        server.grpc_write_timeout_s. A peer that takes none has its connection closed by the
        relay: grpcio can neither cancel a call whose write is pending nor send it a status, so
        only a closed connection frees the call. Where the relay does not know the call (it has
        just closed), the write is cancelled and the stream ended as far as grpcio allows."""
        write = asyncio.ensure_future(ctx.write(resp))
        # A failure after a cut is expected (the call is gone): retrieved, not logged by asyncio.
        write.add_done_callback(lambda w: w.cancelled() or w.exception())
        done, _ = await asyncio.wait((write,), timeout=self.write_s)
        if write in done:
            write.result()
            return
        cut = self._stalled(ctx)
        if cut:
            # grpcio cancels this handler once it sees the close; the wait is a bound in case not.
            await asyncio.wait((write,), timeout=self.write_s)
        else:
            write.cancel()
        raise StreamStalledError(_stalled_words(self.write_s, cut))

    def watch(self, ctx: Ctx) -> None:
        """Bound the delivery of a unary answer, which grpcio writes after the handler returns:
        a call not done within server.grpc_write_timeout_s has its connection cut. A timer and
        a done-callback per call: the answer's write itself is grpcio's."""
        # The callback runs once grpcio has finished the call (context.done() already reads
        # True when the handler returns, delivered or not).
        timer = asyncio.get_running_loop().call_later(self.write_s, self._stalled, ctx)
        ctx.add_done_callback(lambda _: timer.cancel())

    def _stalled(self, ctx: Ctx) -> bool:
        """Cut the connection of a call whose peer takes no data, logged; False where the relay
        knows no such connection."""
        peer = ctx.peer()
        who = self.label(peer)  # before the cut, which forgets the connection
        cut = self.cut(peer)  # the close happens on the loop's next turns: logged first
        _stalls.note(logging.WARNING, "stalled", "gRPC peer %s: %s", who, _stalled_words(self.write_s, cut))
        return cut

    def _generates(self, name: str) -> bool:
        rt = self.service.registry.models.get(name)
        return rt is not None and gen.is_language_model(rt.cfg)

    async def _generate(self, p: Parsed, ctx: Ctx) -> None:
        name = self.service.resolve(p.name, p.version)
        prompt, body = await asyncio.to_thread(_generation_request, p) if p.large else _generation_request(p)
        job = gen.make_job(self.service.model(name).cfg, body, gen.request_timeout(self.service, name), prompt=prompt)
        model, version = self.service.versions().served(name)
        async for piece in gen.stream(self.service, name, job, p.id, _TRANSPORT):
            await self._write(ctx, _text_response(model, version, p.id, piece, final=False))
        await self._write(ctx, _text_response(model, version, p.id, None, final=True))


def _check_size(p: Parsed, json_bytes: int) -> None:
    """HTTP's JSON part's limit: the fields other than the raw contents (typed values, names,
    parameters: what HTTP carries as JSON) within server.max_json."""
    fields = p.fields
    if fields > json_bytes:
        raise PayloadTooLargeError(
            f"the request's fields other than its raw contents are {fields} bytes, over the limit of "
            f"{json_bytes} (server.max_json); send large tensors as raw contents or shared memory"
        )


def _decoded(p: Parsed, shm: Any, limits: Limits = DEFAULT_LIMITS) -> InferRequest:
    """A request that no plan decodes, through the shared decoder (its typed contents become
    arrays here: on a thread for a large message)."""
    doc, raws, _ = request_document(p.message(), p.raws)
    return decode_document(doc, raws, shm, limits)


def _document(msg: pb.ModelInferRequest, raws: Sequence[bytes | memoryview]) -> dict[str, Any]:
    return request_document(msg, raws)[0]


def _streamed_error(message: str) -> bytes:
    return bytes(pb.ModelStreamInferResponse(error_message=message).SerializeToString())


def _generation_request(p: Parsed) -> tuple[str, dict[str, Any]]:
    """(the prompt, the sampling parameters) of a request in the form Triton's vLLM backend
    takes: a BYTES input ``text_input``, optional ``sampling_parameters`` (a JSON object as a
    BYTES input or a request parameter), and any request parameters (max_tokens, temperature)."""
    import orjson

    req = _decoded(p, None)
    text = req.inputs.get("text_input")
    if text is None or text.size != 1:
        raise BadRequestError("a language model's request needs one BYTES input 'text_input'")
    body: dict[str, Any] = {k: v for k, v in req.parameters.items() if k != "sampling_parameters"}
    raw = req.inputs.get("sampling_parameters")
    sampling = raw.reshape(-1)[0] if raw is not None and raw.size == 1 else req.parameters.get("sampling_parameters")
    if sampling:
        try:
            extra = orjson.loads(sampling)
        except orjson.JSONDecodeError as e:
            raise BadRequestError(f"'sampling_parameters' is not JSON: {e}") from None
        if not isinstance(extra, dict):
            raise BadRequestError("'sampling_parameters' must be a JSON object")
        body.update(extra)
    body.pop("stream", None)
    try:
        prompt = bytes(text.reshape(-1)[0]).decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequestError("'text_input' is not UTF-8 text") from None
    return prompt, body


def _text_response(model: str, version: str, rid: str, piece: str | None, final: bool) -> bytes:
    resp = pb.ModelInferResponse(model_name=model, model_version=version, id=rid)
    if piece is not None:
        resp.outputs.add(name="text_output", datatype="BYTES", shape=[1])
        resp.raw_output_contents.append(serialize_bytes(np.array([piece.encode()], dtype=object)))
    set_parameter(resp.parameters, "triton_final_response", final)
    return bytes(pb.ModelStreamInferResponse(infer_response=resp).SerializeToString())


def _stalled_words(write_s: float, cut: bool) -> str:
    return f"the peer took no response within {write_s} s (server.grpc_write_timeout_s): " + (
        "its connection closed" if cut else "call cancelled"
    )
