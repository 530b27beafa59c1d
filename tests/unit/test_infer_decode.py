"""KServe v2 infer requests decoded into tensors (edged.wire.decode, and edged.wire.jsonchild for
large JSON bodies): JSON and binary tensors, the shared memory parameters, and hostile input
(malformed, oversized, deeply nested) refused with a 4xx, bounded before it is walked. Large
bodies are decoded off the loop, on a thread or in a child process, with the same results and errors."""

from __future__ import annotations

import asyncio

import numpy as np
import orjson
import pytest

from edged.errors import BadRequestError, InvalidInputError, PayloadTooLargeError, SharedMemoryNotFoundError
from edged.wire.decode import OFFLOAD_BYTES, Limits, decode_infer, parse_header_length
from edged.wire.jsonchild import decode_infer_async


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


def test_an_output_in_shared_memory_without_it_is_refused_not_answered_inline() -> None:
    """MQTT has no shared memory: an output asking for a region is a 400, as an input is."""
    doc = {
        "inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}],
        "outputs": [{"name": "y", "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 4}}],
    }
    with pytest.raises(BadRequestError, match="output 'y': shared memory is not available"):
        decode_infer(orjson.dumps(doc), None, None)
    del doc["outputs"]
    assert decode_infer(orjson.dumps(doc), None, None).outputs is None


# --- hostile input: bounded, linear, and always a 4xx ---------------------------------------


@pytest.mark.parametrize("raw", [b"12", "0", b"007"])
def test_header_length_accepts_plain_digits(raw: bytes | str) -> None:
    assert parse_header_length(raw) == int(raw)


@pytest.mark.parametrize("raw", [b" 12", b"+12", b"1_000", b"-1", b"", b"12 ", "١٢", b"1" * 19, b"0x10", b"1e3"])
def test_header_length_is_strict(raw: bytes | str) -> None:
    with pytest.raises(BadRequestError, match="decimal integer"):
        parse_header_length(raw)


def test_duplicate_and_excess_names_are_refused_before_the_lists_are_walked() -> None:
    outputs = [{"name": "y"}] * 3
    x = {"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}
    with pytest.raises(BadRequestError, match="output 'y' is given twice"):
        decode_infer(orjson.dumps({"inputs": [x], "outputs": outputs}))
    # The model's own counts bound the lists: a longer list is refused before it is looked at.
    few = [{"name": f"x{i}", "bogus": True} for i in range(3)]
    with pytest.raises(InvalidInputError, match="lists 3 inputs; model 'm' has 1"):
        decode_infer(orjson.dumps({"inputs": few}), limits=Limits(1, 1, "m"))
    with pytest.raises(InvalidInputError, match="asks for 3 outputs; model 'm' has 1"):
        decode_infer(orjson.dumps({"inputs": [x], "outputs": outputs}), limits=Limits(1, 1, "m"))
    # Many objects are refused by counting braces, before the body is parsed at all.
    many = [{"name": f"x{i}", "bogus": True} for i in range(5000)]
    with pytest.raises(InvalidInputError, match=r"more JSON objects than a request for model 'm' can \(20\)"):
        decode_infer(orjson.dumps({"inputs": many}), limits=Limits(1, 1, "m"))
    with pytest.raises(InvalidInputError, match="more JSON objects"):
        decode_infer(orjson.dumps({"inputs": many}))
    with pytest.raises(InvalidInputError, match="lists 1100 inputs; a request may name at most 1024"):
        decode_infer(orjson.dumps({"inputs": [[]] * 1100}))


def test_json_part_is_bounded_by_max_json() -> None:
    x = {"name": "x", "shape": [1000], "datatype": "FP32", "data": [0.5] * 1000}
    body = orjson.dumps({"inputs": [x]})
    with pytest.raises(PayloadTooLargeError, match="server.max_json"):
        decode_infer(body, limits=Limits(json_bytes=1000))
    assert decode_infer(body, limits=Limits(json_bytes=len(body))).inputs["x"].shape == (1000,)


def test_a_late_duplicate_among_40000_names_is_found() -> None:
    """The duplicate check over 40,000 names (a set: a quadratic list scan would take 11 s); how
    long it takes is for the integration test's health prober, not for a timed unit test."""
    names = [{"name": f"n{i}", "shape": [1], "datatype": "FP32", "data": [0]} for i in range(40_000)]
    names.append(dict(names[0]))
    body = orjson.dumps({"inputs": names})
    with pytest.raises(BadRequestError, match="input 'n0' is given twice"):
        decode_infer(body, limits=Limits(50_000, 1, json_bytes=len(body)))


@pytest.mark.parametrize(
    ("shape", "data", "needle"),
    [
        ([2**40, 2**40], [1], "more than"),
        ([0, 2**62, 2**62], [], "more than"),
        ([1] * 33, [1], "at most 32"),
        ([True], [1], "non-negative integers"),
        ([3], [[1, 2, 3]], "not laid out"),
        ([2, 2], [[1, 2], [3]], "not laid out"),
        ([2, 2], [1, 2, 3], "needs 4 values"),
        ([2], [[1], [2]], "needs 2 values"),
        ([2], 5, "must be a list"),
        ([2], [1, {"a": 1}], "does not hold"),
        ([1], [300], "does not hold"),
    ],
)
def test_json_data_checked_against_shape_before_conversion(shape: list[object], data: object, needle: str) -> None:
    body = orjson.dumps({"inputs": [{"name": "x", "shape": shape, "datatype": "UINT8", "data": data}]})
    with pytest.raises(BadRequestError, match=needle):
        decode_infer(body)


def test_json_nested_flat_scalar_and_empty_layouts() -> None:
    def one(shape: list[int], data: object) -> np.ndarray:
        body = orjson.dumps({"inputs": [{"name": "x", "shape": shape, "datatype": "INT32", "data": data}]})
        return decode_infer(body).inputs["x"]

    assert one([2, 2], [1, 2, 3, 4]).tolist() == [[1, 2], [3, 4]]
    assert one([2, 2], [[1, 2], [3, 4]]).tolist() == [[1, 2], [3, 4]]
    assert one([], 7).tolist() == 7
    assert one([2, 0], [[], []]).shape == (2, 0)
    assert one([0, 3], []).shape == (0, 3)


def test_shm_size_is_checked_before_the_region_is_touched() -> None:
    touched: list[str] = []

    def resolver(name: str, offset: int, size: int) -> memoryview:
        touched.append(name)
        return memoryview(bytearray(size))

    params = {"shared_memory_region": "r", "shared_memory_byte_size": 4 * 2**30}
    body = orjson.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "parameters": params}]})
    with pytest.raises(BadRequestError, match="needs 4 bytes"):
        decode_infer(body, None, resolver)
    assert touched == []


@pytest.mark.parametrize(
    ("params", "extra", "needle"),
    [
        ({"shared_memory_byte_size": 4}, {}, "without 'shared_memory_region'"),
        ({"shared_memory_region": "r"}, {}, "needs 'shared_memory_byte_size'"),
        ({"shared_memory_region": "r", "shared_memory_byte_size": 4}, {"data": [1]}, "give one of"),
        ({"shared_memory_region": "", "shared_memory_byte_size": 4}, {}, "non-empty string"),
    ],
)
def test_shm_parameters_as_the_extension_states(
    params: dict[str, object], extra: dict[str, object], needle: str
) -> None:
    body = orjson.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "parameters": params, **extra}]})
    with pytest.raises(BadRequestError, match=needle):
        decode_infer(body, None, lambda n, o, s: memoryview(bytearray(s)))


def test_async_decode_offloads_large_bodies_with_the_same_result() -> None:
    data = np.arange(OFFLOAD_BYTES // 2, dtype=np.float32)
    body = orjson.dumps(
        {"inputs": [{"name": "x", "shape": [len(data)], "datatype": "FP32", "data": data}]},
        option=orjson.OPT_SERIALIZE_NUMPY,
    )
    assert len(body) > OFFLOAD_BYTES
    req = asyncio.run(decode_infer_async(body))
    np.testing.assert_array_equal(req.inputs["x"], data)
    with pytest.raises(BadRequestError, match="malformed JSON"):
        asyncio.run(decode_infer_async(body[:-1]))


def test_large_json_is_parsed_in_a_child_process_with_the_same_results_and_errors() -> None:
    from edged.wire import jsonchild

    x = np.arange(40_000, dtype=np.float32).reshape(2_500, 16)
    inp = {"name": "x", "shape": [2_500, 16], "datatype": "FP32", "data": x.tolist()}
    body = orjson.dumps({"id": "big", "inputs": [inp], "outputs": [{"name": "y"}]})
    assert len(body) > OFFLOAD_BYTES
    req = asyncio.run(decode_infer_async(body, limits=Limits(1, 1, "m")))
    np.testing.assert_array_equal(req.inputs["x"], x)
    assert req.id == "big" and req.outputs is not None and req.outputs[0].name == "y"
    child = jsonchild._CHILD._proc
    assert child is not None and child.poll() is None
    # The child raises what the daemon would: same class, same message.
    two = orjson.dumps({"inputs": [inp, dict(inp, name="x2")]})
    with pytest.raises(InvalidInputError, match="lists 2 inputs; model 'm' has 1"):
        asyncio.run(decode_infer_async(two, limits=Limits(1, 1, "m")))
    with pytest.raises(BadRequestError, match=r"not laid out as shape \[2500, 17\] \(axis 1\)"):
        asyncio.run(decode_infer_async(body.replace(b'"shape":[2500,16]', b'"shape":[2500,17]')))
    # A child that died is replaced on the next request.
    child.kill()
    child.wait()
    assert asyncio.run(decode_infer_async(body)).inputs["x"].shape == (2_500, 16)
    assert jsonchild._CHILD._proc is not child
