"""Inference answers encoded (edged.wire.encode, through edged.wire.decode): JSON and binary
outputs and the outputs a request names, large answers in parts or on a worker thread beside an
output in shared memory, and non-finite values read and written in the JSON Triton writes."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import orjson
import pytest

from edged.errors import BadRequestError
from edged.wire.decode import (
    InferRequest,
    OutputRequest,
    decode_infer,
    encode_infer,
    encode_infer_async,
    encode_infer_parts,
)


def test_encode_json_binary_and_requested_outputs() -> None:
    results: dict[str, np.ndarray] = {
        "a": np.arange(4, dtype=np.float16).reshape(2, 2),
        "b": np.array([1, 2], np.int32),
    }
    body, hl = encode_infer("m", InferRequest(id="q"), results)
    assert hl is None
    doc = orjson.loads(body)
    assert doc["id"] == "q" and doc["outputs"][0]["datatype"] == "FP16" and doc["outputs"][0]["data"] == [0, 1, 2, 3]
    body, hl = encode_infer("m", InferRequest(outputs=[OutputRequest("b", binary=True)]), results)
    assert hl is not None
    doc = orjson.loads(body[:hl])
    assert [o["name"] for o in doc["outputs"]] == ["b"]
    assert np.frombuffer(body[hl:], np.int32).tolist() == [1, 2]
    with pytest.raises(BadRequestError, match="not an output"):
        encode_infer("m", InferRequest(outputs=[OutputRequest("zz")]), results)


def test_large_results_are_encoded_in_parts_with_the_same_meaning() -> None:
    """Large outputs are serialised in slices (JSON) or not copied at all (binary); the joined
    parts read back exactly like the one-piece encoding of the same results."""
    rng = np.random.default_rng(1)
    results: dict[str, np.ndarray] = {
        "a": rng.random((300_000, 2), dtype=np.float32),
        "b": np.arange(100_000, dtype=np.int64),
    }
    req = InferRequest(id="r1", outputs=[OutputRequest("a"), OutputRequest("b", binary=True)])
    parts, header_len = encode_infer_parts("m", req, results)
    assert len(parts) > 3 and header_len is not None
    body = b"".join(parts)
    doc = orjson.loads(body[:header_len])
    assert doc["id"] == "r1" and doc["model_name"] == "m"
    a = doc["outputs"][0]
    assert a["shape"] == [300_000, 2]
    np.testing.assert_array_equal(np.asarray(a["data"], np.float32), results["a"].reshape(-1))
    assert doc["outputs"][1]["parameters"]["binary_data_size"] == 800_000
    np.testing.assert_array_equal(np.frombuffer(body[header_len:], np.int64), results["b"])
    whole, whole_len = encode_infer("m", req, results)
    assert whole == body and whole_len == header_len
    # On the loop: the same parts, encoded on a worker thread.
    async_parts, async_len = asyncio.run(encode_infer_async("m", req, results))
    assert b"".join(async_parts) == body and async_len == header_len


def test_non_finite_values_in_json_as_triton_writes_them() -> None:
    body = b'{"inputs":[{"name":"x","shape":[4],"datatype":"FP32","data":[NaN,Infinity,-Infinity,1.5]}]}'
    x = decode_infer(body).inputs["x"]
    assert np.isnan(x[0]) and x[1] == np.inf and x[2] == -np.inf and x[3] == 1.5
    with pytest.raises(BadRequestError, match="does not hold INT32"):
        decode_infer(body.replace(b"FP32", b"INT32"))
    with pytest.raises(BadRequestError, match="malformed JSON"):
        decode_infer(body.replace(b"NaN", b"NaNa"))
    with pytest.raises(BadRequestError, match="malformed JSON"):
        decode_infer(b'{"inputs":' + b"[" * 100_000 + b"NaN" + b"]" * 100_000 + b"}")
    # Outputs: "NaN", "Infinity" and "-Infinity" (strict JSON), not null, small and large alike.
    small = {"y": np.array([np.nan, np.inf, -np.inf, 0.25], np.float16)}
    out, _ = encode_infer("m", InferRequest(), small)
    assert b'["NaN","Infinity","-Infinity",0.25]' in out
    big = np.zeros(200_000, np.float32)
    big[123_456] = -np.inf
    body, _ = encode_infer("m", InferRequest(), {"y": big})
    data = orjson.loads(body)["outputs"][0]["data"]
    assert len(data) == 200_000 and data[123_456] == "-Infinity" and data[0] == 0.0
    assert np.array(data, np.float32)[123_456] == -math.inf


def test_large_json_outputs_beside_a_shared_memory_output_are_encoded_off_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The region is taken on the loop; the JSON of a large output is encoded on a thread."""
    import threading

    from edged.wire import encode as encoding
    from edged.wire.decode import InferRequest, OutputRequest, encode_infer_async

    big = np.linspace(0, 1, 100_000, dtype=np.float32)
    small = np.arange(4, dtype=np.float32)
    req = InferRequest("r", {}, [OutputRequest("big", False), OutputRequest("small", False)])
    req.outputs[1].shm_region, req.outputs[1].shm_offset, req.outputs[1].shm_size = "out", 0, 16  # type: ignore[index]
    dest = np.zeros(4, np.float32)
    resolved_on: list[str] = []
    encoded_on: list[str] = []
    parts_fn = encoding.encode_infer_parts

    def resolver(region: str, offset: int, size: int) -> memoryview:
        resolved_on.append(threading.current_thread().name)
        return dest.data.cast("B")

    def where(*args: object) -> object:
        encoded_on.append(threading.current_thread().name)
        return parts_fn(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(encoding, "encode_infer_parts", where)
    parts, header_len = asyncio.run(encode_infer_async("m", req, {"big": big, "small": small}, resolver))
    doc = orjson.loads(b"".join(bytes(p) for p in parts))
    assert header_len is None and np.allclose(doc["outputs"][0]["data"], big)
    assert doc["outputs"][1]["parameters"] == {"shared_memory_region": "out", "shared_memory_byte_size": 16}
    assert dest.tolist() == small.tolist()
    assert resolved_on == [threading.main_thread().name] and encoded_on[0] != threading.main_thread().name
    with pytest.raises(BadRequestError, match="needs 16 bytes, region 'out' was given 8"):
        req.outputs[1].shm_size = 8  # type: ignore[index]
        asyncio.run(encode_infer_async("m", req, {"big": big, "small": small}, resolver))
