"""The common gRPC inference call read and written at the wire: what every request of a client
shares is found by its bytes, and what every answer of a model shares is serialized once.

Triton's clients and the generated stubs send, for every request of one client, the same input
and output records (names, datatypes, shapes) and only another id and other raw contents. So a
``ModelInferRequest`` is read field by field here (every field of it is length-delimited: a key
byte and a varint length each), its raw contents taken as views of the message, and its input
and output records, byte for byte, are the key of the request's plan (``decode.PlanCache``): the
plan made from the first such request, parsed by protobuf, decodes the rest without protobuf.
Equal records are equal tensors, so a key cannot name another request's plan. A message this
reading does not take (request parameters, a field ModelInferRequest lacks, more than
``MAX_FIELDS`` fields, a malformed varint, a name that is not UTF-8) is parsed by protobuf as
any other, and its faults named there.

An answer's head (model, version, each output's name, datatype and shape) is serialized by
protobuf once per model, version and output shapes (``AnswerHeads``); each answer adds its id
and its raw contents as the fields they are, in field order: the bytes protobuf's own
serialization gives for the whole message.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from edged.wire.decode import decode_planned
from edged.wire.plans import PlanCache, RequestPlan, check_within, plan_document
from edged.wire.proto import grpc_service_pb2 as pb
from edged.wire.tensors import InferRequest, ShmResolver, datatype_of, is_bytes, tensor_bytes
from edged.wire.validate import Limits

# More fields than this (inputs, outputs and raw contents together, with the three names) and
# the message is left to protobuf: the reading is Python, a step per field.
MAX_FIELDS = 64

# Outputs up to this size are copied into the answer's parts (see ``answer``).
_COPIED = 64 * 1024

# ModelInferRequest's field numbers.
_NAME, _VERSION, _ID, _INPUT, _OUTPUT, _RAW = 1, 2, 3, 5, 6, 7
# The wire keys (field number << 3 | length-delimited) of ModelInferResponse's id (3) and
# raw_output_contents (6), and of ModelStreamInferResponse's infer_response (2).
_ID_KEY = bytes([_ID << 3 | 2])
RAW_OUTPUT_KEY = bytes([6 << 3 | 2])
STREAM_RESPONSE_KEY = bytes([2 << 3 | 2])

# Plans of requests by their input and output records (the bytes of a client's usual request
# header): at most 1 MiB of keys, none over 8 KiB.
WIRE_PLANS = PlanCache(1 << 20, 8192)


@dataclass(frozen=True, slots=True)
class WireRequest:
    """A ModelInferRequest's fields as read at the wire; ``raws`` are views of the message."""

    name: str
    version: str
    id: str
    key: bytes  # its input and output records, in order: the key of its plan
    inputs: int
    outputs: int
    raws: list[memoryview]


def read_request(data: bytes) -> WireRequest | None:
    """The request's fields, or None where protobuf should read it (see the module's text)."""
    view = memoryview(data)
    end = len(data)
    name = version = rid = ""
    records: list[memoryview] = []
    raws: list[memoryview] = []
    inputs = outputs = fields = pos = 0
    while pos < end:
        fields += 1
        key = data[pos]
        # A one-byte key of a length-delimited field, numbered from 1 (0 is no field number).
        if fields > MAX_FIELDS or key & 0x87 != 2 or key < 8:
            return None
        start = pos
        pos += 1
        size = shift = 0
        while True:  # the field's length: a varint of at most five bytes
            if pos >= end or shift > 28:
                return None
            byte = data[pos]
            pos += 1
            size |= (byte & 0x7F) << shift
            if byte < 0x80:
                break
            shift += 7
        body, pos = pos, pos + size
        if pos > end:
            return None
        number = key >> 3
        if number == _RAW:
            raws.append(view[body:pos])
        elif number in (_INPUT, _OUTPUT):
            records.append(view[start:pos])
            inputs += number == _INPUT
            outputs += number == _OUTPUT
        elif number <= _ID:
            try:
                text = str(data[body:pos], "utf-8")
            except UnicodeDecodeError:
                return None
            if number == _NAME:
                name = text
            elif number == _VERSION:
                version = text
            else:
                rid = text
        else:  # request parameters, or a field of another message
            return None
    return WireRequest(name, version, rid, b"".join(records), inputs, outputs, raws)


def planned(
    wire: WireRequest,
    message: Callable[[], pb.ModelInferRequest],
    shm: ShmResolver | None,
    limits: Limits,
    document: Callable[[pb.ModelInferRequest, Sequence[bytes | memoryview]], dict[str, object]],
    plan: RequestPlan | None = None,
) -> InferRequest | None:
    """The request decoded by the plan of its records (made from ``message()`` on their first
    sight, when its inputs are all raw contents of their shapes' sizes: ``document`` gives the
    document to plan); None where it is not of that kind or its raw contents are not its
    shapes' sizes (the full decoder then says what is wrong). ``plan``: the one found for its
    records already (where a large request was read on a thread)."""
    if plan is None:
        plan = WIRE_PLANS.get(wire.key)
    if plan is None:
        msg = message()
        if len(msg.raw_input_contents) != len(msg.inputs) or any(
            t.parameters or t.HasField("contents") for t in msg.inputs
        ):
            return None
        if any(o.parameters for o in msg.outputs):
            return None
        doc = document(msg, wire.raws)
        doc.pop("id", None)
        plan = plan_document(doc, limits)
        if plan.layout is None:
            return None
        WIRE_PLANS.put(wire.key, plan)
    layout = plan.layout
    assert layout is not None  # only such plans are remembered
    if len(wire.raws) != len(layout) or any(
        len(raw) != end - start for raw, (_, _, _, start, end) in zip(wire.raws, layout)
    ):
        return None
    check_within(plan, limits)
    return decode_planned(plan, wire.id, wire.raws, shm)


class AnswerHeads:
    """Serialized ModelInferResponse heads without their id, by model, version and outputs: the
    fields before the id (model and version) and those after it (the output tensors). Bounded:
    a model whose output shapes vary with each request starts the table over at ``limit``."""

    def __init__(self, limit: int = 1024) -> None:
        self.limit = limit
        self._heads: dict[tuple[object, ...], tuple[bytes, bytes]] = {}
        self._lock = threading.Lock()  # large answers are made on worker threads

    def head(self, model: str, version: str, outputs: Sequence[tuple[str, np.ndarray]]) -> tuple[bytes, bytes]:
        key = (model, version, *((name, arr.dtype, arr.shape) for name, arr in outputs))
        got = self._heads.get(key)
        if got is not None:
            return got
        before = pb.ModelInferResponse(model_name=model, model_version=version).SerializeToString()
        whole = pb.ModelInferResponse(model_name=model, model_version=version)
        for name, arr in outputs:
            whole.outputs.add(name=name, datatype=datatype_of(arr.dtype), shape=arr.shape)
        after = whole.SerializeToString()[len(before) :]
        with self._lock:
            if len(self._heads) >= self.limit:
                self._heads.clear()
            self._heads[key] = (before, after)
        return before, after


HEADS = AnswerHeads()


def answer(
    model: str, version: str, req: InferRequest, results: Mapping[str, np.ndarray], stream: bool
) -> bytes | None:
    """The serialized answer of a request whose outputs all travel in the message (None where one
    is bound for shared memory, or a requested output is not among ``results``: ``response_parts``
    answers those, and names the fault)."""
    if req.outputs is None:
        outputs = list(results.items())
    else:
        outputs = []
        for out in req.outputs:
            arr = results.get(out.name)
            if arr is None or out.shm_region is not None:
                return None
            outputs.append((out.name, arr))
    before, after = HEADS.head(model, version, outputs)
    head = [before, after]
    if req.id:
        rid = req.id.encode()
        head[1:1] = [_ID_KEY, varint(len(rid)), rid]
    # Small contents are copied at once (one numpy call, where a view takes four and a copy).
    raws = [
        arr.tobytes() if arr.nbytes <= _COPIED and not is_bytes(arr.dtype) else tensor_bytes(arr) for _, arr in outputs
    ]
    return framed(head, raws, stream)


def framed(head: list[bytes], raws: Sequence[bytes | memoryview], stream: bool) -> bytes:
    """A ModelInferResponse of ``head`` (its fields before the raw contents, serialized) with
    ``raws`` as its raw_output_contents, as a ModelStreamInferResponse's ``infer_response`` when
    ``stream``: each raw content framed as its field (key, length, bytes), all joined in one copy."""
    parts: list[bytes | memoryview] = list(head)
    if any(len(r) for r in raws):
        for r in raws:
            parts += [RAW_OUTPUT_KEY, varint(len(r)), r]
    if stream:
        parts[:0] = [STREAM_RESPONSE_KEY, varint(sum(len(p) for p in parts))]
    return b"".join(parts)


def varint(n: int) -> bytes:
    """protobuf's base-128 varint: seven bits a byte, low first, the high bit on all but the last."""
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)
