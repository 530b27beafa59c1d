"""A ModelInferRequest as received by the gRPC transport: its names, counts, raw contents and size.

A request is read at the wire where it can be (wire/kserve_wire.py: its raw contents are views of
the bytes grpcio handed over), and parsed by protobuf otherwise, or on demand where something needs
the message itself. Protobuf copies a bytes field on every access, so a parsed message's raw
contents are taken from it once, here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from edged.errors import BadRequestError
from edged.wire.encode import OFFLOAD_BYTES
from edged.wire.kserve_wire import WIRE_PLANS, WireRequest, read_request
from edged.wire.plans import RequestPlan
from edged.wire.proto import grpc_service_pb2 as pb

# Typed values and other fields beyond this many bytes are decoded on a thread (about a
# millisecond of conversion on a small board).
_FIELDS_ON_LOOP = 16 * 1024


@dataclass(slots=True)
class Parsed:
    """A ModelInferRequest as received: its names and counts, its raw contents taken out once,
    its size on the wire; read at the wire (``wire``) or parsed by protobuf (``msg``), and
    parsed by protobuf on demand (``message``) where it was read at the wire."""

    data: bytes
    name: str
    version: str
    id: str
    inputs: int
    outputs: int
    raws: Sequence[bytes | memoryview]
    size: int
    fields: int  # the bytes of everything but the raw contents: typed values, names, parameters
    wire: WireRequest | None = None
    msg: pb.ModelInferRequest | None = None
    plan: RequestPlan | None = None  # its records' plan, where it was looked up on the reading thread

    @classmethod
    def read(cls, data: bytes) -> Parsed:
        """Read at the wire where it can be, else parsed; a large message whose records have no
        plan yet is parsed here too (this runs on a thread for a large one)."""
        wire = read_request(data)
        if wire is None:
            return cls.of(data, _parse(data))
        fields = len(data) - sum(len(r) for r in wire.raws)
        p = cls(data, wire.name, wire.version, wire.id, wire.inputs, wire.outputs, wire.raws, len(data), fields, wire)
        if p.large:  # on a thread: the plan kept for the loop, or the message parsed here
            p.plan = WIRE_PLANS.get(wire.key)
            if p.plan is None:
                p.msg = _parse(data)
        return p

    @classmethod
    def of(cls, data: bytes, msg: pb.ModelInferRequest) -> Parsed:
        raws = list(msg.raw_input_contents)
        fields = len(data) - sum(map(len, raws))
        return cls(
            data,
            msg.model_name,
            msg.model_version,
            msg.id,
            len(msg.inputs),
            len(msg.outputs),
            raws,
            len(data),
            fields,
            None,
            msg,
        )

    def message(self) -> pb.ModelInferRequest:
        if self.msg is None:
            self.msg = _parse(self.data)
        return self.msg

    @property
    def large(self) -> bool:
        """Whether decoding it belongs on a thread: a message past OFFLOAD_BYTES (BYTES elements
        are read one by one), or typed values past _FIELDS_ON_LOOP (a packed INT8 value is one
        byte on the wire and a Python object to convert)."""
        return self.size > OFFLOAD_BYTES or self.fields > _FIELDS_ON_LOOP


def _parse(data: bytes) -> pb.ModelInferRequest:
    try:
        return pb.ModelInferRequest.FromString(data)
    except DecodeError as e:
        raise BadRequestError(f"the message is not a ModelInferRequest: {e}") from None
