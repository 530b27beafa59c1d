"""BYTES tensors on the wire: Triton's length-prefixed framing, JSON strings, the
encoder, the MQTT raw form and the large-JSON child, checked against tritonclient.utils."""

from __future__ import annotations

import struct

import numpy as np
import orjson
import pytest
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from edged.client import decode_response, encode_request
from edged.errors import BadRequestError
from edged.transports.mqtt import codec
from edged.wire.decode import DEFAULT_LIMITS, InferRequest, decode_infer, encode_infer, finish_decode, resolve_pending
from edged.wire.jsonchild import parse_in_child
from edged.wire.tensors import (
    deserialize_bytes,
    from_json_data,
    parse_dtype,
    serialize_bytes,
    tensor_bytes,
    v2_datatype,
)

WORDS = np.array([[b"", b"a\x00b"], ["h\u00e9".encode(), b"\xff\xfe"]], dtype=object)


def test_framing_is_tritons_both_ways() -> None:
    raw = serialize_bytes(WORDS)
    assert raw == serialize_byte_tensor(WORDS).item()
    assert deserialize_bytes(raw, (2, 2), "x").tolist() == WORDS.tolist()
    assert deserialize_bytes_tensor(raw).tolist() == WORDS.reshape(-1).tolist()
    assert serialize_bytes(np.array([], dtype=object)) == b"" and deserialize_bytes(b"", (0, 3), "x").shape == (0, 3)


def test_the_datatype_is_bytes() -> None:
    assert parse_dtype("BYTES", "x") == np.dtype(object)
    assert v2_datatype("object") == v2_datatype("bytes40") == v2_datatype("str96") == "BYTES"


@pytest.mark.parametrize(
    ("raw", "shape", "message"),
    [
        (
            struct.pack("<I", 2**32 - 1) + b"ab",
            (1,),
            r"element 0's length prefix \(4294967295 bytes, at byte 0\) runs past",
        ),
        (struct.pack("<I", 3) + b"abc" + b"\x00\x00", (2,), "element 1 has no room for its 4-byte length"),
        (struct.pack("<I", 0) * 2, (1,), "4 bytes follow the last of its 1 BYTES elements"),
        (b"", (1,), r"needs at least 4 bytes \(a 4-byte length per element\), got 0"),
        (b"\0" * 8, (2**40,), "needs at least 4398046511104 bytes"),  # before any allocation
    ],
)
def test_bad_framing_is_a_precise_400(raw: bytes, shape: tuple[int, ...], message: str) -> None:
    with pytest.raises(BadRequestError, match=message):
        deserialize_bytes(raw, shape, "input 'text'")


def test_json_strings_are_utf8_bytes() -> None:
    arr = from_json_data([["", "a\u0000b"], ["h\u00e9", "x"]], np.dtype(object), (2, 2), "x")
    assert arr.tolist() == [[b"", b"a\x00b"], ["h\u00e9".encode(), b"x"]]
    assert from_json_data("one", np.dtype(object), (), "x").tolist() == b"one"
    for bad, message in (([1], "must hold strings, element 0 is int"), ([["a", "b"]], "needs 1 values")):
        with pytest.raises(BadRequestError, match=message):
            from_json_data(bad, np.dtype(object), (1,), "x")


def test_requests_decode_in_every_form() -> None:
    raw = serialize_bytes(WORDS)
    meta = {"name": "t", "datatype": "BYTES", "shape": [2, 2], "parameters": {"binary_data_size": len(raw)}}
    header = orjson.dumps({"inputs": [meta, {"name": "f", "datatype": "FP32", "shape": [1], "data": [1]}]})
    req = decode_infer(header + raw, len(header))
    assert req.inputs["t"].tolist() == WORDS.tolist() and req.inputs["f"].tolist() == [1.0]

    region = bytearray(raw)
    shm_meta = dict(meta, parameters={"shared_memory_region": "r", "shared_memory_byte_size": len(raw)})
    req = decode_infer(
        orjson.dumps({"inputs": [shm_meta]}), shm=lambda name, off, size: memoryview(region)[off : off + size]
    )
    assert req.inputs == {} and len(req.pending) == 1  # read once ShmRequest.fill copied the bytes in
    resolve_pending(req)
    assert req.inputs["t"].tolist() == WORDS.tolist() and not req.pending


def test_large_json_with_bytes_crosses_the_child() -> None:
    text = [f"w{i}" for i in range(20_000)]  # a JSON part over 64 KiB: parsed in the child
    body = orjson.dumps({"inputs": [{"name": "t", "datatype": "BYTES", "shape": [len(text)], "data": text}]})
    req = finish_decode(parse_in_child(body, None, DEFAULT_LIMITS))
    assert req.inputs["t"].dtype == object and req.inputs["t"].tolist() == [t.encode() for t in text]


def test_responses_encode_as_json_strings_or_length_prefixed() -> None:
    ok = np.array([b"a", "\u00e9".encode()], dtype=object)
    body, hl = encode_infer("m", InferRequest(), {"o": ok})
    assert hl is None and orjson.loads(body)["outputs"][0] == {
        "name": "o",
        "datatype": "BYTES",
        "shape": [2],
        "data": ["a", "\u00e9"],
    }
    body, hl = encode_infer("m", InferRequest(binary_all=True), {"o": WORDS})
    assert hl is not None and deserialize_bytes_tensor(body[hl:]).tolist() == WORDS.reshape(-1).tolist()
    assert decode_response(body, hl)["o"].tolist() == WORDS.tolist()
    with pytest.raises(BadRequestError, match="element 3 is not UTF-8 text, which JSON cannot carry"):
        encode_infer("m", InferRequest(), {"o": WORDS})
    big = np.array([b"x" * 100] * 2000, dtype=object)  # the large path
    body, hl = encode_infer("m", InferRequest(), {"o": big, "f": np.zeros(20_000, np.float32)})
    assert decode_response(body, hl)["o"].tolist() == big.tolist()


def test_the_client_sends_strings_and_bytes_alike() -> None:
    body, headers = encode_request({"t": np.array(["a", "\u00e9"]), "u": np.array([b"a", b"\xff"], dtype=object)})
    hl = int(headers["Inference-Header-Content-Length"])
    req = decode_infer(body, hl)
    assert req.inputs["t"].tolist() == [b"a", "\u00e9".encode()] and req.inputs["u"].tolist() == [b"a", b"\xff"]


def test_a_raw_mqtt_bytes_tensor_and_reply() -> None:
    inc = codec.Incoming("t", serialize_bytes(WORDS), content_type=codec.OCTET, user={"dtype": "BYTES", "shape": "2,2"})
    dec = codec.decode_raw(inc)
    assert dec.raw_tensor is not None and dec.raw_tensor.tolist() == WORDS.tolist()
    reply = codec.raw_reply("m", {"o": WORDS}, None)
    assert reply.payload == bytes(tensor_bytes(WORDS)) and ("dtype", "BYTES") in reply.user
    inc.user["shape"] = "5"
    with pytest.raises(BadRequestError, match="the raw tensor: BYTES element 4 has no room"):
        codec.decode_raw(inc)
