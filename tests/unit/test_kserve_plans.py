"""gRPC requests read at the wire and planned once (edged/wire/kserve_wire.py): a
ModelInferRequest of raw contents with no parameters is decoded by the plan remembered for its
input and output records, whatever its id and bytes; any other request is left to protobuf and
the full decoder (and its faults named there). Answers are the bytes protobuf writes."""

from __future__ import annotations

import numpy as np
import pytest

from edged.errors import BadRequestError
from edged.wire.decode import DEFAULT_LIMITS, Limits
from edged.wire.kserve import request_document, response_parts, serialized_answer
from edged.wire.kserve_wire import MAX_FIELDS, WIRE_PLANS, WireRequest, answer, planned, read_request
from edged.wire.proto import grpc_service_pb2 as pb
from edged.wire.tensors import InferRequest, OutputRequest


def _request(rid: str = "", rows: int = 1, raw: bytes | None = None, name: str = "x") -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name="tiny", model_version="2", id=rid)
    msg.inputs.add(name=name, datatype="FP32", shape=[rows, 16])
    msg.raw_input_contents.append(raw if raw is not None else np.arange(rows * 16, dtype=np.float32).tobytes())
    msg.outputs.add(name="probs")
    return msg


def _read(msg: pb.ModelInferRequest) -> WireRequest:
    wire = read_request(msg.SerializeToString())
    assert wire is not None
    return wire


def _planned(msg: pb.ModelInferRequest, limits: Limits = DEFAULT_LIMITS) -> InferRequest | None:
    return planned(_read(msg), lambda: msg, None, limits, lambda m, raws: request_document(m, raws)[0])


def test_the_wire_reading_gives_protobufs_fields() -> None:
    msg = _request("req-7")
    msg.raw_input_contents.append(b"second")
    wire = _read(msg)
    assert (wire.name, wire.version, wire.id, wire.inputs, wire.outputs) == ("tiny", "2", "req-7", 1, 1)
    assert [bytes(r) for r in wire.raws] == list(msg.raw_input_contents)


def test_a_length_written_long_is_read_as_protobuf_reads_it() -> None:
    data = b"\x0a\x84\x00tiny" + _request().SerializeToString()[6:]  # the name's length in two bytes
    assert pb.ModelInferRequest.FromString(data).model_name == "tiny"
    wire = read_request(data)
    assert wire is not None and wire.name == "tiny" and wire.key == _read(_request()).key


def test_whatever_the_reading_takes_protobuf_reads_alike() -> None:
    """Mutated messages (seeded): where the wire reading takes one and protobuf parses it, both
    give the same names, counts and raw contents."""
    rng = np.random.default_rng(7)
    base = bytearray(_request("id").SerializeToString())
    compared = 0
    for _ in range(3000):
        data = bytearray(base)
        for at in rng.integers(0, len(data), size=rng.integers(1, 4)):
            data[at] = int(rng.integers(0, 256))
        wire = read_request(bytes(data))
        if wire is None:
            continue
        try:
            msg = pb.ModelInferRequest.FromString(bytes(data))
        except Exception:
            continue  # a record the reading passes whole, which protobuf refuses: planned from it never
        compared += 1
        assert (wire.name, wire.version, wire.id) == (msg.model_name, msg.model_version, msg.id)
        assert (wire.inputs, wire.outputs) == (len(msg.inputs), len(msg.outputs))
        assert [bytes(r) for r in wire.raws] == list(msg.raw_input_contents)
    assert compared > 100


def test_requests_of_one_client_share_one_plan_and_keep_their_ids() -> None:
    WIRE_PLANS.clear()
    first = _planned(_request("a"))
    second = _planned(_request("b", raw=np.ones(16, np.float32).tobytes()))
    assert first is not None and second is not None
    assert first.shapes is second.shapes is not None  # one plan: the model's check is remembered by it
    assert len(WIRE_PLANS) == 1
    assert (first.id, second.id) == ("a", "b")
    np.testing.assert_array_equal(second.inputs["x"], np.ones((1, 16), np.float32))
    assert [o.name for o in second.outputs or ()] == ["probs"]


def test_other_shapes_and_names_are_other_plans() -> None:
    keys = {_read(_request(rows=1)).key, _read(_request(rows=2)).key, _read(_request(name="y")).key}
    assert len(keys) == 3
    # Not the id, the version or the bytes.
    assert _read(_request("a", raw=b"\1" * 64)).key == _read(_request("b")).key


def test_requests_not_of_that_kind_are_planned_whole() -> None:
    WIRE_PLANS.clear()
    wrong_size = _request(raw=b"\0" * 60)
    assert _planned(wrong_size) is None  # the full decoder says why
    assert _planned(_request()) is not None
    assert _planned(wrong_size) is None  # also once the plan is known
    typed = pb.ModelInferRequest(model_name="tiny")
    typed.inputs.add(name="x", datatype="FP32", shape=[1, 1]).contents.fp32_contents.append(1.0)
    assert _planned(typed) is None
    tensor_params = _request()
    tensor_params.inputs[0].parameters["shared_memory_region"].string_param = "r"
    assert _planned(tensor_params) is None
    assert len(WIRE_PLANS) == 1


def test_messages_the_reading_does_not_take_are_left_to_protobuf() -> None:
    with_params = _request()
    with_params.parameters["priority"].int64_param = 1
    many = _request()
    for i in range(MAX_FIELDS):
        many.outputs.add(name=f"o{i}")
    good = _request().SerializeToString()
    for data in (
        with_params.SerializeToString(),
        many.SerializeToString(),
        good[:-3],  # a field cut short
        b"\x0a\x02\xff\xfe",  # a model name that is not UTF-8
        b"\x08\x01",  # a varint field: no field of ModelInferRequest is one
        good + b"\x02\x04evil",  # field number 0, which protobuf refuses
        b"\x0a\xff\xff\xff\xff\xff\x01",  # a length of more than five bytes
    ):
        assert read_request(data) is None


def test_a_remembered_plan_is_held_to_each_models_limits() -> None:
    WIRE_PLANS.clear()
    assert _planned(_request()) is not None
    with pytest.raises(BadRequestError):
        _planned(_request(), Limits(inputs=1, outputs=0, model="none"))


@pytest.mark.parametrize("rid", ["", "an-id", "x" * 300])
@pytest.mark.parametrize("stream", [False, True])
def test_answers_are_the_bytes_protobuf_writes(rid: str, stream: bool) -> None:
    outputs = {"probs": np.arange(10, dtype=np.float32).reshape(1, 10), "label": np.array([b"cat"], dtype=object)}
    for wanted in (None, [OutputRequest("label"), OutputRequest("probs")]):
        req = InferRequest(rid, {}, wanted, False, {})
        got = answer("tiny", "2", req, outputs, stream)
        assert got == serialized_answer(*response_parts("tiny", "2", req, outputs), stream)
        again = answer("tiny", "2", req, outputs, stream)  # from the remembered head
        assert again == got


def test_answers_with_an_output_in_shared_memory_or_missing_are_left_to_protobuf() -> None:
    outputs = {"probs": np.zeros((1, 10), np.float32)}
    in_region = InferRequest("", {}, [OutputRequest("probs", shm_region="r", shm_size=40)], False, {})
    missing = InferRequest("", {}, [OutputRequest("nope")], False, {})
    assert answer("tiny", "", in_region, outputs, False) is None
    assert answer("tiny", "", missing, outputs, False) is None
