"""The Open Inference Protocol (KServe v2) infer body: JSON tensors, the binary tensor data
extension, and the system shared memory extension's tensor parameters.

Both transports decode with this module (MQTT carries the same JSON as the HTTP body), so the
same input is parsed the same way everywhere. It checks that a request is well formed and
self-consistent, with the wire rules of edged/wire/tensors.py and the request bounds of
edged/wire/validate.py; whether its tensors fit the model is validate.py's ``InputRules``, which the
service runs once per request.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
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
from edged.wire.request_ids import ID_MEMBER, TEMPLATES, cut, request_id, without_id
from edged.wire.tensors import NUMPY_TO_V2 as NUMPY_TO_V2
from edged.wire.tensors import V2_TO_NUMPY as V2_TO_NUMPY
from edged.wire.tensors import InferRequest as InferRequest
from edged.wire.tensors import OutputRequest as OutputRequest
from edged.wire.tensors import ShmResolver as ShmResolver
from edged.wire.tensors import deserialize_bytes, from_bytes, from_json_data, is_bytes, parse_dtype, parse_shape
from edged.wire.tensors import v2_datatype as v2_datatype
from edged.wire.validate import DEFAULT_LIMITS as DEFAULT_LIMITS
from edged.wire.validate import MAX_JSON as MAX_JSON
from edged.wire.validate import MAX_TENSORS as MAX_TENSORS
from edged.wire.validate import Limits as Limits
from edged.wire.validate import check_bytes_inputs, check_counts, check_json_size
from edged.wire.validate import check_json_part as check_json_part

# Inference-Header-Content-Length: ASCII digits only, and no more than this many of them.
_MAX_DIGITS = 18
# Headers at most this long are remembered with their plan; the cache holds at most _PLAN_BYTES
# of them (a stream's header is a few hundred bytes; a failed request's is never kept).
_PLAN_HEADER_MAX = 8192
_PLAN_BYTES = 1 << 20


def parse_header_length(raw: str | bytes, what: str = "Inference-Header-Content-Length") -> int:
    """A strict non-negative decimal: Python's int() also takes ' 12', '+12' and '1_000'."""
    text = raw.decode("latin-1") if isinstance(raw, bytes) else raw
    if not text or len(text) > _MAX_DIGITS or not (text.isascii() and text.isdigit()):
        raise BadRequestError(f"{what} must be a decimal integer of at most {_MAX_DIGITS} digits")
    return int(text)


def _obj(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadRequestError(f"{what} must be a JSON object")
    return value


def _int_param(params: Mapping[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = params.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadRequestError(f"{where}: parameter '{key}' must be a non-negative integer")
    return value


def _shm_params(params: Mapping[str, Any], where: str) -> tuple[str, int, int] | None:
    """(region, offset, byte size), or None when no region is named; the extension's rules:
    a region needs its byte size, and offset or byte size without a region is an error."""
    if "shared_memory_region" not in params:
        for key in ("shared_memory_byte_size", "shared_memory_offset") if params else ():
            if key in params:
                raise BadRequestError(f"{where}: '{key}' without 'shared_memory_region'")
        return None
    region = params["shared_memory_region"]
    if not isinstance(region, str) or not region:
        raise BadRequestError(f"{where}: 'shared_memory_region' must be a non-empty string")
    if "shared_memory_byte_size" not in params:
        raise BadRequestError(f"{where}: 'shared_memory_region' needs 'shared_memory_byte_size'")
    return (
        region,
        _int_param(params, "shared_memory_offset", where, 0),
        _int_param(params, "shared_memory_byte_size", where),
    )


@dataclass(frozen=True)
class _InputPlan:
    """One input as its header describes it; the tensor bytes are found per request."""

    name: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    kind: str  # "json" | "binary" | "shm"
    size: int = 0
    region: str = ""
    offset: int = 0
    data: Any = None


def _plan_input(raw: Any, idx: int) -> _InputPlan:
    inp = _obj(raw, f"inputs[{idx}]")
    name = inp.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequestError(f"inputs[{idx}]: 'name' must be a non-empty string")
    where = f"input '{name}'"
    shape = parse_shape(inp.get("shape"), where)
    dtype = parse_dtype(inp.get("datatype"), where)
    params = _obj(inp.get("parameters") or {}, f"{where}: 'parameters'")
    shm = _shm_params(params, where)
    if params and ("data" in inp) + (shm is not None) + ("binary_data_size" in params) > 1:
        raise BadRequestError(f"{where}: give one of 'data', 'binary_data_size' or 'shared_memory_region'")
    if shm is not None:
        return _InputPlan(name, dtype, shape, "shm", shm[2], shm[0], shm[1])
    if "binary_data_size" in params:
        return _InputPlan(name, dtype, shape, "binary", _int_param(params, "binary_data_size", where))
    if "data" not in inp:
        raise BadRequestError(f"{where}: needs 'data', binary data or a shared memory region")
    return _InputPlan(name, dtype, shape, "json", data=inp["data"])


def _binary_part(p: _InputPlan, binary: memoryview, offset: int) -> memoryview:
    if offset + p.size > len(binary):
        raise BadRequestError(f"input '{p.name}': 'binary_data_size' {p.size} runs past the end of the binary data")
    return binary[offset : offset + p.size]


def _materialize(
    p: _InputPlan, binary: memoryview, offset: int, shm: ShmResolver | None, req: InferRequest
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


def decode_binary_bytes(plan: _RequestPlan, binary: memoryview, arrays: dict[str, np.ndarray]) -> None:
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


def _decode_output(raw: Any, binary_all: bool, idx: int) -> OutputRequest:
    out = _obj(raw, f"outputs[{idx}]")
    name = out.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequestError(f"outputs[{idx}]: 'name' must be a non-empty string")
    where = f"output '{name}'"
    params = _obj(out.get("parameters") or {}, f"{where}: 'parameters'")
    binary = params.get("binary_data", binary_all)
    if not isinstance(binary, bool):
        raise BadRequestError(f"{where}: 'binary_data' must be true or false")
    req = OutputRequest(name, binary)
    shm = _shm_params(params, where)
    if shm is not None:
        req.shm_region, req.shm_offset, req.shm_size = shm
    return req


# Compared and hashed by identity: a plan is one object shared by every request with its header
# (the model's plan remembers the ones whose inputs passed its check, service.ModelPlan.checked).
@dataclass(frozen=True, eq=False)
class _RequestPlan:
    id: str
    binary_all: bool
    parameters: dict[str, Any]
    inputs: tuple[_InputPlan, ...]
    outputs: tuple[OutputRequest, ...] | None
    # Where every input is a numeric tensor in the binary part whose declared size is its shape's
    # (a stream of frames, tiny's requests): (name, dtype, shape, start, end) of each in the
    # binary part, checked once here, so that a cached plan decodes without the per-input steps.
    layout: tuple[tuple[str, np.dtype[Any], tuple[int, ...], int, int], ...] | None = None
    # The last model's limits (validate.Limits, immutable) this plan was found within: a stream
    # of requests with one header is checked against its model's limits once, not per request.
    within: list[Limits | None] = field(default_factory=lambda: [None], compare=False, repr=False)


def _unique(names: Sequence[str], what: str) -> None:
    if len(names) < 2:
        return
    seen: set[str] = set()
    for n in names:
        if n in seen:
            raise BadRequestError(f"{what} '{n}' is given twice")
        seen.add(n)


def load_object(raw: bytes | memoryview, not_object: str, malformed: str = "malformed JSON") -> dict[str, Any]:
    """A strict JSON object (a control message, a generation request, settings), or
    BadRequestError: ``malformed: <orjson's reason>``, or ``not_object`` for any other value."""
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadRequestError(f"{malformed}: {e}") from None
    if not isinstance(doc, dict):
        raise BadRequestError(not_object)
    return doc


# An escaped UTF-16 surrogate (\uD800-\uDFFF), paired or not.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def load_json(header: memoryview | bytes) -> Any:
    """orjson, strict JSON; a document that orjson refuses and that holds NaN or Infinity (which
    Python's json, NumPy and tritonclient write for non-finite values, and Triton accepts) is read
    again with the standard library, which accepts them."""
    try:
        return orjson.loads(header)
    except orjson.JSONDecodeError as e:
        raw = bytes(header)
        if b"NaN" not in raw and b"Infinity" not in raw:
            raise BadRequestError(f"malformed JSON: {e}") from None
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as e2:  # JSONDecodeError, bad UTF-8, too deep, huge ints
            raise BadRequestError(f"malformed JSON: {e2}") from None
        if _SURROGATE_ESCAPE.search(raw) is not None:
            # json takes an escaped lone surrogate, which no answer or error could carry (orjson
            # refuses to write it): refused here, as orjson refuses it. A pair is one character.
            try:
                json.dumps(doc, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:
                raise BadRequestError("malformed JSON: a string holds a lone UTF-16 surrogate") from None
            except RecursionError:  # as deep as json.loads could go: no deeper is written
                raise BadRequestError("malformed JSON: nested too deeply") from None
        return doc


# What other wire modules hold a plan as (kserve_wire.py keeps one found on a worker thread).
RequestPlan = _RequestPlan


def _plan(header: memoryview | bytes, limits: Limits) -> _RequestPlan:
    return plan_document(load_json(header), limits)


def plan_document(doc: Any, limits: Limits) -> _RequestPlan:
    """The request's plan from its parsed JSON: every field checked, nothing converted yet."""
    doc = _obj(doc, "request body")
    inputs_raw = doc.get("inputs")
    if not isinstance(inputs_raw, list) or not inputs_raw:
        raise BadRequestError("'inputs' must be a non-empty list")
    outputs_raw = doc.get("outputs")
    if outputs_raw is not None and not isinstance(outputs_raw, list):
        raise BadRequestError("'outputs' must be a list")
    check_counts(len(inputs_raw), len(outputs_raw or ()), limits)
    params = _obj(doc.get("parameters") or {}, "'parameters'")
    binary_all = params.get("binary_data_output", False)
    if not isinstance(binary_all, bool):
        raise BadRequestError("parameter 'binary_data_output' must be true or false")
    inputs = tuple(_plan_input(raw, idx) for idx, raw in enumerate(inputs_raw))
    check_bytes_inputs(((p.name, is_bytes(p.dtype)) for p in inputs), limits)
    _unique([p.name for p in inputs], "input")
    outputs = None
    if outputs_raw is not None:
        outputs = tuple(_decode_output(o, binary_all, i) for i, o in enumerate(outputs_raw))
        _unique([o.name for o in outputs], "output")
    return _RequestPlan(request_id(doc.get("id", "")), binary_all, params, inputs, outputs, _layout(inputs))


def _layout(inputs: tuple[_InputPlan, ...]) -> tuple[tuple[str, np.dtype[Any], tuple[int, ...], int, int], ...] | None:
    """``_RequestPlan.layout`` for these inputs; None where any is not a binary numeric tensor of
    exactly its shape's size (those take the per-input path, which says what is wrong)."""
    layout = []
    start = 0
    for p in inputs:
        if p.kind != "binary" or is_bytes(p.dtype) or p.size != math.prod(p.shape) * p.dtype.itemsize:
            return None
        layout.append((p.name, p.dtype, p.shape, start, start + p.size))
        start += p.size
    return tuple(layout)


class PlanCache:
    """Plans of binary-extension headers, bounded by bytes (LRU). Clients send the same header
    for every frame of a stream (only the bytes after it change), so it is parsed once."""

    def __init__(self, max_bytes: int, max_header: int) -> None:
        self.max_bytes, self.max_header = max_bytes, max_header
        self.bytes = 0
        self._plans: OrderedDict[bytes, _RequestPlan] = OrderedDict()
        self._lock = threading.Lock()  # large bodies are decoded on a worker thread

    def get(self, key: bytes) -> _RequestPlan | None:
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
            return plan

    def put(self, key: bytes, plan: _RequestPlan) -> None:
        if len(key) > self.max_header or any(p.kind == "json" and p.data is not None for p in plan.inputs):
            return  # a plan holding a request's values is that request's alone
        with self._lock:
            if key in self._plans:
                return
            self._plans[key] = plan
            self.bytes += len(key)
            while self.bytes > self.max_bytes:
                old, _ = self._plans.popitem(last=False)
                self.bytes -= len(old)

    def __len__(self) -> int:
        return len(self._plans)

    def distinct(self) -> int:
        """How many plans it holds: one may be cached under its header and its id's template."""
        with self._lock:
            return len({id(plan) for plan in self._plans.values()})

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()
            self.bytes = 0


PLANS = PlanCache(_PLAN_BYTES, _PLAN_HEADER_MAX)


@dataclass
class ParsedBody:
    """The part of decoding that may be slow (JSON parsing, JSON data to arrays): it touches
    no shared memory and no event-loop state, so it may run on a worker thread."""

    plan: _RequestPlan
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
            plan = _plan(header, limits)
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
    plan: _RequestPlan,
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


def _cached(key: bytes | None) -> tuple[_RequestPlan | None, str | None, tuple[bytes, str, int, int] | None]:
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


def _finish(parsed: ParsedBody, plan: _RequestPlan, req: InferRequest, shm: ShmResolver | None) -> InferRequest:
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


def check_within(plan: _RequestPlan, limits: Limits) -> None:
    """A remembered plan against this model's limits (once per model, as ``parse_body`` does)."""
    if plan.within[0] is not limits:
        check_counts(len(plan.inputs), len(plan.outputs or ()), limits)
        check_bytes_inputs(((p.name, is_bytes(p.dtype)) for p in plan.inputs), limits)
        plan.within[0] = limits


def decode_planned(
    plan: _RequestPlan, rid: str, parts: Sequence[bytes | memoryview], shm: ShmResolver | None
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


def _typed(p: _InputPlan) -> np.ndarray:
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
