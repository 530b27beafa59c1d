"""ModelInferRequest to tensors and tensors to ModelInferResponse (edged/wire/kserve.py), through
the shared decoder's rules."""

from __future__ import annotations

import numpy as np
import pytest

from edged.errors import BadRequestError
from edged.wire.decode import decode_document
from edged.wire.kserve import (
    parameters_of,
    request_document,
    response_parts,
    serialized_answer,
)
from edged.wire.kserve_wire import varint
from edged.wire.proto import grpc_service_pb2 as pb
from edged.wire.tensors import InferRequest, OutputRequest


def _message(model: str, version: str, req: InferRequest, out: dict[str, np.ndarray]) -> pb.ModelInferResponse:
    """The answer built whole by protobuf: ``response_parts`` with its raw contents put in."""
    resp, raws = response_parts(model, version, req, out)
    if any(len(r) for r in raws):
        resp.raw_output_contents.extend(bytes(r) for r in raws)
    return resp


def _decode(msg: pb.ModelInferRequest) -> InferRequest:
    doc, raws, _ = request_document(msg)
    return decode_document(doc, raws, None)


def test_raw_contents_are_read_in_place() -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    msg = pb.ModelInferRequest(model_name="m", id="7")
    msg.inputs.add(name="x", datatype="FP32", shape=[2, 3])
    msg.raw_input_contents.append(x.tobytes())
    req = _decode(msg)
    assert req.id == "7"
    np.testing.assert_array_equal(req.inputs["x"], x)
    assert not req.inputs["x"].flags.owndata  # a view of the message's bytes


def test_typed_contents_and_bytes() -> None:
    msg = pb.ModelInferRequest(model_name="m")
    t = msg.inputs.add(name="a", datatype="INT32", shape=[2])
    t.contents.int_contents.extend([1, -2])
    s = msg.inputs.add(name="s", datatype="BYTES", shape=[2])
    s.contents.bytes_contents.extend([b"x", b"\xff"])
    req = _decode(msg)
    assert req.inputs["a"].dtype == np.int32 and list(req.inputs["a"]) == [1, -2]
    assert list(req.inputs["s"]) == [b"x", b"\xff"]


def test_the_shared_rules_and_messages_apply() -> None:
    msg = pb.ModelInferRequest(model_name="m")
    msg.inputs.add(name="x", datatype="FP32", shape=[2, 3])
    msg.raw_input_contents.append(b"\0" * 8)
    with pytest.raises(BadRequestError, match=r"shape \[2, 3\] of FP32 needs 24 bytes, got 8"):
        _decode(msg)
    bad = pb.ModelInferRequest(model_name="m")
    bad.inputs.add(name="x", datatype="FP99", shape=[1])
    bad.raw_input_contents.append(b"\0")
    with pytest.raises(BadRequestError, match="datatype"):
        _decode(bad)
    twice = pb.ModelInferRequest(model_name="m")
    for _ in range(2):
        twice.inputs.add(name="x", datatype="UINT8", shape=[1])
        twice.raw_input_contents.append(b"\0")
    with pytest.raises(BadRequestError, match="given twice"):
        _decode(twice)
    both = pb.ModelInferRequest(model_name="m")
    both.inputs.add(name="x", datatype="INT32", shape=[1]).contents.int_contents.append(1)
    both.raw_input_contents.append(b"\0" * 4)
    with pytest.raises(BadRequestError, match="contents field must not be specified when using raw_input_contents"):
        _decode(both)


def test_raw_contents_must_match_the_inputs() -> None:
    msg = pb.ModelInferRequest(model_name="m")
    msg.inputs.add(name="x", datatype="UINT8", shape=[1])
    msg.raw_input_contents.extend([b"\0", b"\0"])
    with pytest.raises(BadRequestError, match="raw input contents"):
        request_document(msg)


def test_shared_memory_parameters_pass_through() -> None:
    msg = pb.ModelInferRequest(model_name="m")
    t = msg.inputs.add(name="x", datatype="FP32", shape=[1])
    t.parameters["shared_memory_region"].string_param = "r"
    t.parameters["shared_memory_byte_size"].int64_param = 4
    doc, raws, _ = request_document(msg)
    assert raws == [] and doc["inputs"][0]["parameters"] == {"shared_memory_region": "r", "shared_memory_byte_size": 4}
    with pytest.raises(BadRequestError, match="shared memory is not available"):
        decode_document(doc, raws, None)


def test_the_response_holds_every_output_raw() -> None:
    req = InferRequest("r1", outputs=[OutputRequest("b"), OutputRequest("a")])
    out = {"a": np.ones((1, 2), np.float32), "b": np.array([b"hi"], dtype=object)}
    resp = _message("m", "1", req, out)
    assert [o.name for o in resp.outputs] == ["b", "a"] and resp.id == "r1"
    assert resp.outputs[0].datatype == "BYTES" and resp.raw_output_contents[0] == b"\x02\x00\x00\x00hi"
    np.testing.assert_array_equal(np.frombuffer(resp.raw_output_contents[1], np.float32), [1, 1])
    assert parameters_of(resp.parameters) == {}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "outputs",
    [
        {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([b"hi", b""], dtype=object)},
        {"a": np.zeros((1, 300), np.int64)[:, ::3]},  # not contiguous: its bytes are copied
        {"a": np.zeros((0, 4), np.float32)},  # no raw contents at all: the field is left out
    ],
)
def test_a_serialized_answer_is_protobufs_own(outputs: dict[str, np.ndarray], stream: bool) -> None:
    """The raw contents framed by hand, the rest by protobuf: the very bytes SerializeToString
    gives for the whole message (so every client parses them as it always did)."""
    req = InferRequest("r7", outputs=[OutputRequest(n) for n in outputs])
    resp = _message("m", "2", req, outputs)
    want = pb.ModelStreamInferResponse(infer_response=resp) if stream else resp
    got = serialized_answer(*response_parts("m", "2", req, outputs), stream)
    assert got == want.SerializeToString()


@pytest.mark.parametrize("n", [0, 1, 127, 128, 300, 16384, 2**21, 2**28 + 5])
def test_varints_are_protobufs(n: int) -> None:
    # A bytes field of n bytes: protobuf writes its length as the varint.
    msg = pb.ModelInferResponse(raw_output_contents=[b"x" * n]) if n < 2**22 else None
    if msg is not None:
        assert msg.SerializeToString() == bytes([6 << 3 | 2]) + varint(n) + b"x" * n
    assert _decode_varint(varint(n)) == n


def _decode_varint(data: bytes) -> int:
    value = 0
    for i, b in enumerate(data):
        value |= (b & 0x7F) << (7 * i)
        if not b & 0x80:
            assert i == len(data) - 1
            return value
    raise AssertionError("unterminated")
