"""The Open Inference Protocol (KServe v2) infer body: JSON tensors, the binary tensor data
extension, and the system shared memory extension's tensor parameters.

Both transports decode with this module (MQTT carries the same JSON as the HTTP body), so the
same input is parsed the same way everywhere. It checks that a request is well formed and
self-consistent, with the wire rules of edged/wire/tensors.py and the request bounds of
edged/wire/validate.py; whether its tensors fit the model is validate.py's ``InputRules``, which the
service runs once per request. A header's fields are checked once, into its plan (plans.py), which
every later request with the same header is decoded by; JSON is read by jsondoc.py.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import orjson

from edged.errors import BadRequestError

# Re-exported: the transports, the client and the tests import the protocol from here.
from edged.wire.encode import OFFLOAD_BYTES as OFFLOAD_BYTES
from edged.wire.encode import Part as Part
from edged.wire.encode import encode_infer as encode_infer
from edged.wire.encode import encode_infer_async as encode_infer_async
from edged.wire.encode import encode_infer_parts as encode_infer_parts
from edged.wire.jsondoc import load_json
from edged.wire.plans import PLANS, InputPlan, RequestPlan, check_within, plan_document
from edged.wire.request_ids import ID_MEMBER, TEMPLATES, cut, request_id, without_id
from edged.wire.tensors import NUMPY_TO_V2 as NUMPY_TO_V2
from edged.wire.tensors import V2_TO_NUMPY as V2_TO_NUMPY
from edged.wire.tensors import InferRequest as InferRequest
from edged.wire.tensors import OutputRequest as OutputRequest
from edged.wire.tensors import ShmResolver as ShmResolver
from edged.wire.tensors import deserialize_bytes, from_bytes, from_json_data, is_bytes
from edged.wire.tensors import v2_datatype as v2_datatype
from edged.wire.validate import DEFAULT_LIMITS as DEFAULT_LIMITS
from edged.wire.validate import MAX_JSON as MAX_JSON
from edged.wire.validate import MAX_TENSORS as MAX_TENSORS
from edged.wire.validate import Limits as Limits
from edged.wire.validate import check_json_part as check_json_part
from edged.wire.validate import check_json_size

# Inference-Header-Content-Length: ASCII digits only, and no more than this many of them.
_MAX_DIGITS = 18


def parse_header_length(raw: str | bytes, what: str = "Inference-Header-Content-Length") -> int:
    """A strict non-negative decimal: Python's int() also takes ' 12', '+12' and '1_000'."""
    text = raw.decode("latin-1") if isinstance(raw, bytes) else raw
    if not text or len(text) > _MAX_DIGITS or not (text.isascii() and text.isdigit()):
        raise BadRequestError(f"{what} must be a decimal integer of at most {_MAX_DIGITS} digits")
    return int(text)


def _binary_part(p: InputPlan, binary: memoryview, offset: int) -> memoryview:
    if offset + p.size > len(binary):
        raise BadRequestError(f"input '{p.name}': 'binary_data_size' {p.size} runs past the end of the binary data")
    return binary[offset : offset + p.size]


def _materialize(
    p: InputPlan, binary: memoryview, offset: int, shm: ShmResolver | None, req: InferRequest
) -> tuple[np.ndarray | None, int]:
    """(the tensor, or None for a BYTES tensor in shared memory, read once its bytes are copied
    in: ``resolve_pending``; the offset of the next binary input)."""
    where = f"input '{p.name}'"
    if p.kind == "shm":
        if shm is None:
            raise BadRequestError(f"{where}: shared memory is not available on this transport")
        if is_bytes(p.dtype):  # its size is the serialised form's, known only to the client
            req.pending.append((p.name, shm(p.region, p.offset, p.size), p.shape))
            return None, offset
        need = math.prod(p.shape) * p.dtype.itemsize
        if p.size != need:  # checked before the region is touched
            raise BadRequestError(
                f"{where}: shape {list(p.shape)} of {v2_datatype(p.dtype.name)} needs {need} bytes, "
                f"'shared_memory_byte_size' is {p.size}"
            )
        return from_bytes(shm(p.region, p.offset, p.size), p.dtype, p.shape, where), offset
    if p.kind == "binary":
        return from_bytes(_binary_part(p, binary, offset), p.dtype, p.shape, where), offset + p.size
    raise AssertionError("JSON inputs are converted by parse_body")


def decode_binary_bytes(plan: RequestPlan, binary: memoryview, arrays: dict[str, np.ndarray]) -> None:
    """BYTES tensors in the binary part, read in ``parse_body`` (the slow part, which may run on
    a worker thread): their framing is walked element by element."""
    offset = 0
    for p in plan.inputs:
        if p.kind != "binary":
            continue
        if is_bytes(p.dtype):
            arrays[p.name] = deserialize_bytes(_binary_part(p, binary, offset), p.shape, f"input '{p.name}'")
        offset += p.size


def resolve_pending(req: InferRequest) -> None:
    """BYTES inputs from shared memory, once ``ShmRequest.fill`` has copied their bytes in."""
    for name, buf, shape in req.pending:
        req.inputs[name] = deserialize_bytes(buf, shape, f"input '{name}'")
    req.pending.clear()


async def resolve_pending_async(req: InferRequest) -> None:
    """``resolve_pending`` for the event loop: large ones on a worker thread."""
    if not req.pending:
        return
    if sum(len(buf) for _, buf, _ in req.pending) <= OFFLOAD_BYTES:
        resolve_pending(req)
    else:
        await asyncio.to_thread(resolve_pending, req)


@dataclass
class ParsedBody:
    """The part of decoding that may be slow (JSON parsing, JSON data to arrays): it touches
    no shared memory and no event-loop state, so it may run on a worker thread."""

    plan: RequestPlan
    key: bytes | None  # the header, when the plan may be cached once the request decodes
    binary: memoryview
    arrays: dict[str, np.ndarray]
    id: str | None = None  # the request's id where the plan was cached without it
    template: bytes | None = None  # the key of the header's id template, cached with the plan too


def parse_body(body: bytes | memoryview, header_length: int | None, limits: Limits = DEFAULT_LIMITS) -> ParsedBody:
    view = memoryview(body)
    key = None
    rid: str | None = None
    plain = header_length is None
    if header_length is None:
        # Plain JSON is all header. One whose tensors are in shared memory (Triton's clients
        # send those without the binary extension) is the same bytes for every frame, so it is
        # planned once like a binary header; one with its values inline is planned once per
        # form, its values read each time (_parse_values).
        header_length = len(view)
    elif header_length > len(view):
        raise BadRequestError(f"Inference-Header-Content-Length {header_length} exceeds the body ({len(view)} bytes)")
    header = view[:header_length]
    # A header starting with a NUL byte is no JSON: never looked up, so that no client can
    # reach the plans cached under keys made without their id (request_ids) by sending one.
    key = header.tobytes() if header_length <= PLANS.max_header and bytes(header[:1]) != b"\x00" else None
    if plain and key is not None and _DATA_MEMBER in key:
        return _parse_values(view, key, limits)
    cached, rid, where = _cached(key)
    template = None
    # The same header seen by this model: its size was checked then. One matched through its
    # id's template differs in the id, which may make it longer or hold '{'s: checked again.
    within = cached is not None and rid is None and cached.within[0] is limits
    if not within:  # before parsing: its object count is bounded by this model's limits
        check_json_size(body, header_length, limits)
    if cached is None:
        found = without_id(key) if key is not None and ID_MEMBER in key else None
        if found is None:
            plan = plan_document(load_json(header), limits)
        else:
            if where is not None and key is not None:  # before planning: the probe reads the document
                template = TEMPLATES.template_of(key, where, found[2])
            key, rid, doc = found
            cached = PLANS.get(key)
            plan = cached if cached is not None else plan_document(doc, limits)
    if cached is not None:
        check_within(cached, limits)  # planned under another model's limits, maybe
        plan, key = cached, None
    binary = view[header_length:]
    if plan.layout is not None:  # no JSON data, no BYTES: nothing to read here
        return ParsedBody(plan, key, binary, {}, rid, template)
    return _with_values(plan, key, rid, binary, None, template)


def _with_values(
    plan: RequestPlan,
    key: bytes | None,
    rid: str | None,
    binary: memoryview,
    values: list[Any] | None,
    template: bytes | None = None,
) -> ParsedBody:
    """The request's JSON values as arrays (the plan's own, or ``values``, one per input in the
    plan's order), and its BYTES read out of the binary part."""
    arrays = {
        p.name: from_json_data(p.data if values is None else values[i], p.dtype, p.shape, f"input '{p.name}'")
        for i, p in enumerate(plan.inputs)
        if p.kind == "json"
    }
    decode_binary_bytes(plan, binary, arrays)
    return ParsedBody(plan, key, binary, arrays, rid, template)


_DATA_MEMBER = b'"data"'  # a plain JSON request with its values inline (_parse_values)
_VALUES_FORM = b"\x00values form:"  # its document without its values and its id (_form)


def _parse_values(view: memoryview, header: bytes, limits: Limits) -> ParsedBody:
    """A plain JSON request with its values inline: parsed each time (the values are in it), and
    planned once per form, its document without the values and the id (``_form``). Clients send
    one form with new values (and ids) for every request: the plan is checked once, each
    request's values are converted with its types and shapes."""
    check_json_size(header, len(header), limits)  # the bytes: a view would be copied to be counted
    doc = load_json(header)
    form = _form(doc, header)
    end = view[len(view) :]  # no binary part
    if form is None:
        return _with_values(plan_document(doc, limits), None, None, end, None)
    key, rid, values = form
    plan = PLANS.get(key)
    if plan is not None:
        check_within(plan, limits)
        return _with_values(plan, None, rid, end, values)
    planned = plan_document(doc, limits)  # every field checked, the values' presence included
    inputs = tuple(replace(p, data=None) if p.kind == "json" else p for p in planned.inputs)
    return _with_values(replace(planned, id="", inputs=inputs, within=[limits]), key, rid, end, values)


def _form(doc: Any, header: bytes) -> tuple[bytes, str, list[Any]] | None:
    """(the key of a plain JSON request's form, its id, each input's values): the document with
    each input's "data" marked present but not written, and without its id. None for one the
    planner must see whole: not an object, inputs that are not a list of objects, an id that is
    not one, NaN or Infinity (read by the standard library, not written back the same)."""
    if b"NaN" in header or b"Infinity" in header or not isinstance(doc, dict):
        return None
    inputs = doc.get("inputs")
    if not isinstance(inputs, list):
        return None
    values: list[Any] = []
    shapes: list[Any] = []
    for inp in inputs:
        if not isinstance(inp, dict):
            return None
        values.append(inp.get("data"))
        shapes.append({**inp, "data": True} if "data" in inp else inp)
    try:
        rid = request_id(doc.get("id", ""))
        rest = orjson.dumps([{k: v for k, v in doc.items() if k not in ("inputs", "id")}, shapes])
    except (BadRequestError, orjson.JSONEncodeError):
        return None
    return _VALUES_FORM + rest, rid, values


def _cached(key: bytes | None) -> tuple[RequestPlan | None, str | None, tuple[bytes, str, int, int] | None]:
    """The plan of a header seen before: (the plan, the request's id where the plan was found
    by the template around it, where the id's value stands for a template to be made)."""
    if key is None:
        return None, None, None
    cached = PLANS.get(key)
    if cached is not None or ID_MEMBER not in key:
        return cached, None, None
    where = cut(key)
    if where is None:
        return None, None, None
    cached = PLANS.get(where[0])
    return (cached, where[1], None) if cached is not None else (None, None, where)


def finish_decode(parsed: ParsedBody, shm: ShmResolver | None = None) -> InferRequest:
    """The cheap rest, on the caller's thread: binary tensors are views of the body, shared
    memory is resolved, and only a request that decoded completely has its plan remembered."""
    plan, binary = parsed.plan, parsed.binary
    rid = parsed.id if parsed.id is not None else plan.id
    req = InferRequest(rid, {}, None, plan.binary_all, dict(plan.parameters))
    inputs = req.inputs
    layout = plan.layout
    # Never empty where set: plan_document refuses a request without inputs.
    if layout is not None and len(binary) == layout[-1][4]:
        for name, dtype, shape, start, end in layout:
            # As from_bytes does it: frombuffer holds the body while the array lives.
            inputs[name] = np.frombuffer(binary[start:end], dtype=dtype).reshape(shape)
        req.shapes = plan
        return _finish(parsed, plan, req, shm)
    offset = 0
    for p in plan.inputs:
        done = parsed.arrays.get(p.name)  # JSON data, or BYTES read by parse_body
        if done is not None:
            inputs[p.name] = done
            offset += p.size if p.kind == "binary" else 0
            continue
        arr, offset = _materialize(p, binary, offset, shm, req)
        if arr is not None:
            inputs[p.name] = arr
    if offset != len(binary):
        raise BadRequestError(f"{len(binary) - offset} bytes of binary data belong to no input")
    return _finish(parsed, plan, req, shm)


def _finish(parsed: ParsedBody, plan: RequestPlan, req: InferRequest, shm: ShmResolver | None) -> InferRequest:
    """A request whose inputs decoded: its plan remembered, its outputs its own."""
    if parsed.key is not None:
        PLANS.put(parsed.key, plan)
    if parsed.template is not None:
        PLANS.put(parsed.template, plan)
    req.outputs = [o.copy() for o in plan.outputs] if plan.outputs is not None else None
    if shm is None and req.outputs:  # as for inputs: never an answer silently inline instead
        for o in req.outputs:
            if o.shm_region is not None:
                raise BadRequestError(f"output '{o.name}': shared memory is not available on this transport")
    return req


def decode_document(
    doc: Mapping[str, Any],
    parts: Sequence[bytes | memoryview],
    shm: ShmResolver | None,
    limits: Limits = DEFAULT_LIMITS,
) -> InferRequest:
    """A request whose document is parsed already (gRPC's ModelInferRequest, edged/wire/kserve.py)
    and whose binary inputs each come in a buffer of their own (raw_input_contents), in the order
    of the inputs that declare ``binary_data_size``: the same plan, rules and errors as a body."""
    plan = plan_document(doc, limits)
    return decode_planned(plan, plan.id, parts, shm)


def decode_planned(
    plan: RequestPlan, rid: str, parts: Sequence[bytes | memoryview], shm: ShmResolver | None
) -> InferRequest:
    """``decode_document`` with its plan made (or remembered: ``kserve_wire.WIRE_PLANS``) already."""
    req = InferRequest(rid, {}, None, plan.binary_all, dict(plan.parameters))
    layout = plan.layout
    sizes = layout is not None and len(parts) == len(layout)
    if sizes and all(len(part) == end - start for part, (_, _, _, start, end) in zip(parts, layout or ())):
        for part, (name, dtype, shape, _, _) in zip(parts, layout or ()):
            req.inputs[name] = np.frombuffer(part, dtype=dtype).reshape(shape)
        req.shapes = plan  # the model's check of these shapes is remembered by the plan
        return _finish(ParsedBody(plan, None, memoryview(b""), {}), plan, req, shm)
    used = 0
    for p in plan.inputs:
        if p.kind == "json":
            req.inputs[p.name] = _typed(p)
            continue
        buf = memoryview(b"")
        if p.kind == "binary":
            if used == len(parts):
                raise BadRequestError(f"input '{p.name}': no raw contents are left for it")
            buf, used = memoryview(parts[used]), used + 1
        arr, _ = _materialize(p, buf, 0, shm, req)
        if arr is not None:
            req.inputs[p.name] = arr
    if used != len(parts):
        raise BadRequestError(f"{len(parts) - used} raw input contents belong to no input")
    return _finish(ParsedBody(plan, None, memoryview(b""), {}), plan, req, shm)


def _typed(p: InputPlan) -> np.ndarray:
    """An input given as values: an array of them already (gRPC's typed contents), or JSON data."""
    where = f"input '{p.name}'"
    if not isinstance(p.data, np.ndarray):
        return from_json_data(p.data, p.dtype, p.shape, where)
    count = math.prod(p.shape)
    if p.data.size != count:
        raise BadRequestError(f"{where}: shape {list(p.shape)} needs {count} values, {p.data.size} were given")
    try:
        return p.data.astype(p.dtype, copy=False).reshape(p.shape)
    except (ValueError, OverflowError) as e:
        raise BadRequestError(f"{where}: the contents do not hold {v2_datatype(p.dtype.name)} values: {e}") from None


def decode_infer(
    body: bytes | memoryview,
    header_length: int | None = None,
    shm: ShmResolver | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> InferRequest:
    """Parse an infer body: JSON alone, or (binary extension) JSON of ``header_length`` bytes
    followed by the tensors' raw bytes in the order of the inputs that declare them."""
    return finish_decode(parse_body(body, header_length, limits), shm)
