from __future__ import annotations

import numpy as np
import orjson
import pytest

from edged.errors import BadRequestError, SharedMemoryNotFoundError
from edged.protocol import InferRequest, OutputRequest, decode_infer, encode_infer


def test_json_tensor() -> None:
    req = decode_infer(
        orjson.dumps(
            {"id": "7", "inputs": [{"name": "x", "shape": [2, 2], "datatype": "INT64", "data": [[1, 2], [3, 4]]}]}
        )
    )
    assert req.id == "7"
    np.testing.assert_array_equal(req.inputs["x"], np.array([[1, 2], [3, 4]], np.int64))


def test_binary_tensors_in_order() -> None:
    a = np.arange(4, dtype=np.float32)
    b = np.arange(3, dtype=np.uint8)
    header = orjson.dumps(
        {
            "inputs": [
                {"name": "a", "shape": [4], "datatype": "FP32", "parameters": {"binary_data_size": 16}},
                {"name": "b", "shape": [3], "datatype": "UINT8", "parameters": {"binary_data_size": 3}},
            ]
        }
    )
    req = decode_infer(header + a.tobytes() + b.tobytes(), len(header))
    np.testing.assert_array_equal(req.inputs["a"], a)
    np.testing.assert_array_equal(req.inputs["b"], b)


@pytest.mark.parametrize(
    ("doc", "extra", "needle"),
    [
        ({"inputs": [{"name": "x", "shape": [2], "datatype": "FP8", "data": [1, 2]}]}, b"", "unsupported 'datatype'"),
        ({"inputs": [{"name": "x", "shape": [-1], "datatype": "FP32", "data": [1]}]}, b"", "non-negative integers"),
        ({"inputs": [{"name": "x", "shape": [2], "datatype": "FP32"}]}, b"", "needs 'data'"),
        ({"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": ["a", "b"]}]}, b"", "does not hold"),
        (
            {
                "inputs": [
                    {"name": "x", "shape": [1], "datatype": "FP32", "data": [1]},
                    {"name": "x", "shape": [1], "datatype": "FP32", "data": [1]},
                ]
            },
            b"",
            "given twice",
        ),
        (
            {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": 4}}]},
            b"\0" * 8,
            "belong to no input",
        ),
        (
            {"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "parameters": {"binary_data_size": 4}}]},
            b"\0" * 4,
            "needs 8 bytes, got 4",
        ),
    ],
)
def test_malformed_requests(doc: dict[str, object], extra: bytes, needle: str) -> None:
    header = orjson.dumps(doc)
    with pytest.raises(BadRequestError, match=needle):
        decode_infer(header + extra, len(header) if extra else None)


def test_header_length_past_body() -> None:
    with pytest.raises(BadRequestError, match="exceeds the body"):
        decode_infer(b"{}", 10)


def test_shm_resolver_errors_propagate() -> None:
    def resolver(name: str, offset: int, size: int) -> memoryview:
        raise SharedMemoryNotFoundError(f"shared memory region '{name}' is not registered")

    body = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "shape": [1],
                    "datatype": "FP32",
                    "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 4},
                }
            ]
        }
    )
    with pytest.raises(SharedMemoryNotFoundError):
        decode_infer(body, None, resolver)
    with pytest.raises(BadRequestError, match="not available on this transport"):
        decode_infer(body, None, None)


def test_encode_json_binary_and_requested_outputs() -> None:
    results = {"a": np.arange(4, dtype=np.float16).reshape(2, 2), "b": np.array([1, 2], np.int32)}
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
