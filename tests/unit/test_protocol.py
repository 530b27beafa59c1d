from __future__ import annotations

import asyncio
import math
from typing import Any

import numpy as np
import orjson
import pytest

from edged.errors import BadRequestError, InvalidInputError, PayloadTooLargeError, SharedMemoryNotFoundError
from edged.wire.decode import (
    OFFLOAD_BYTES,
    PLANS,
    InferRequest,
    Limits,
    OutputRequest,
    decode_infer,
    encode_infer,
    encode_infer_async,
    encode_infer_parts,
    parse_header_length,
)
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


# --- hostile input: bounded, linear, and always a 4xx ---------------------------------------


def _binary_header(inputs: list[dict[str, object]], **extra: object) -> bytes:
    return orjson.dumps({"inputs": inputs, **extra})


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


def test_plan_cache_keeps_only_successful_small_headers_and_is_bounded_by_bytes() -> None:
    PLANS.clear()
    inp: dict[str, object] = {"name": "x", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": 4}}
    good = _binary_header([inp])
    decode_infer(good + b"\0" * 4, len(good))
    assert len(PLANS) == 1
    # A header whose request fails (binary size mismatch) is not remembered...
    bad = _binary_header([inp], id="failing")
    with pytest.raises(BadRequestError):
        decode_infer(bad + b"\0" * 8, len(bad))
    assert len(PLANS) == 1
    # ...nor is a large header, even of a good request (255 x 4 MiB pinned 1.5 GB before).
    big = _binary_header([inp], id="x" * (64 * 1024))
    for _ in range(3):
        decode_infer(big + b"\0" * 4, len(big))
    assert len(PLANS) == 1
    # Many distinct small headers: the cache stays within its byte bound.
    for i in range(2000):
        h = _binary_header([inp], parameters={"tag": "y" * 900 + str(i)})
        decode_infer(h + b"\0" * 4, len(h))
    assert PLANS.bytes <= PLANS.max_bytes
    assert len(PLANS) < 2000
    PLANS.clear()


def test_requests_that_differ_only_in_their_id_share_one_plan_and_keep_their_own_id() -> None:
    PLANS.clear()
    inp: dict[str, object] = {"name": "x", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": 4}}
    seen = []
    # tritonclient writes the id first, edged.client last; a number is an id too.
    for rid in ("a", "b", 7, "c" * 100):
        for h in (_binary_header([inp], id=rid), orjson.dumps({"id": rid, "inputs": [inp]})):
            req = decode_infer(h + b"\0" * 4, len(h))
            seen.append(req.id)
            assert req.id == str(rid)
    # One plan, whatever the id and wherever it stands: under the header without its id, and
    # under each client's template (the id first, and last).
    assert PLANS.distinct() == 1 and len(PLANS) == 3
    # A request without an id, after them, is planned (and answered) without one.
    h = _binary_header([inp])
    assert decode_infer(h + b"\0" * 4, len(h)).id == ""
    assert len(seen) == 8
    PLANS.clear()


@pytest.mark.parametrize("rid", [True, None, [1], {"a": 1}, 1.5])
def test_a_bad_id_is_refused_even_when_the_rest_is_planned(rid: object) -> None:
    PLANS.clear()
    inp: dict[str, object] = {"name": "x", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": 4}}
    good = _binary_header([inp], id="ok")
    decode_infer(good + b"\0" * 4, len(good))
    bad = _binary_header([inp], id=rid)
    with pytest.raises(BadRequestError, match="'id' must be a string"):
        decode_infer(bad + b"\0" * 4, len(bad))
    PLANS.clear()


def test_numbered_requests_do_not_push_other_plans_out() -> None:
    """Keyed whole, 2,000 numbered requests of one client filled the cache and evicted the
    plan of another client's header."""
    PLANS.clear()
    inp: dict[str, object] = {"name": "x", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": 4}}
    other = _binary_header([dict(inp, name="y")])
    decode_infer(other + b"\0" * 4, len(other))
    for i in range(2000):
        h = _binary_header([inp], id="z" * 900 + str(i))
        assert decode_infer(h + b"\0" * 4, len(h)).id.endswith(str(i))
    assert PLANS.distinct() == 2 and len(PLANS) == 3  # the other's, and the numbered client's twice
    assert PLANS.get(other) is not None
    PLANS.clear()


def test_ids_that_only_look_like_the_member_take_the_normal_path() -> None:
    PLANS.clear()
    inp: dict[str, object] = {"name": "x", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": 4}}
    # "id" inside parameters only, and a header with NaN (read by the standard library).
    nested = _binary_header([inp], parameters={"id": "p"})
    assert decode_infer(nested + b"\0" * 4, len(nested)).id == ""
    with_nan = b'{"id": "n", "inputs": [' + orjson.dumps(inp) + b'], "parameters": {"t": NaN}}'
    req = decode_infer(with_nan + b"\0" * 4, len(with_nan))
    assert req.id == "n" and math.isnan(req.parameters["t"])
    PLANS.clear()


def test_a_header_nested_deeper_than_orjson_writes_still_decodes_with_its_id() -> None:
    """orjson reads 1024 levels and writes 254: the key without the id could not be written, and
    a TypeError escaped (a 500 and a traceback per request)."""
    PLANS.clear()
    inp: dict[str, object] = {"name": "x", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": 4}}
    deep = b"[" * 300 + b"]" * 300
    h = b'{"id":"r1","inputs":[' + orjson.dumps(inp) + b'],"parameters":{"p":' + deep + b"}}"
    assert decode_infer(h + b"\0" * 4, len(h)).id == "r1"
    PLANS.clear()


def test_the_plans_cached_without_their_id_cannot_be_reached_by_a_header() -> None:
    PLANS.clear()
    inp: dict[str, object] = {"name": "x", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": 4}}
    h = _binary_header([inp], id="secret-layout")
    decode_infer(h + b"\0" * 4, len(h))
    probe = b"\x00without id:" + _binary_header([inp])
    with pytest.raises(BadRequestError, match="malformed JSON"):
        decode_infer(probe + b"\0" * 4, len(probe))
    PLANS.clear()


def test_cached_plan_still_obeys_the_model_limits() -> None:
    PLANS.clear()
    a: dict[str, object] = {"name": "a", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": 4}}
    b = dict(a, name="b")
    h = _binary_header([a, b])
    decode_infer(h + b"\0" * 8, len(h))
    with pytest.raises(InvalidInputError, match="lists 2 inputs"):
        decode_infer(h + b"\0" * 8, len(h), limits=Limits(1, 1, "m"))
    PLANS.clear()


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


def test_a_plain_json_request_with_its_tensors_in_shared_memory_is_planned_once(calls_of: Any) -> None:
    import edged.wire.decode as protocol

    planned = calls_of(protocol, "plan_document")
    PLANS.clear()
    shm = {"shared_memory_region": "r", "shared_memory_byte_size": 4}
    inp = {"name": "x", "shape": [1], "datatype": "FP32", "parameters": shm}
    body = orjson.dumps({"inputs": [inp], "outputs": [{"name": "y", "parameters": shm}]})
    region = bytearray(np.float32(2.5).tobytes())
    for _ in range(3):  # Triton's clients send this form, the same bytes for every frame
        req = decode_infer(body, None, lambda n, o, s: memoryview(region)[o : o + s])
        assert req.inputs["x"][0] == 2.5
        assert req.outputs is not None and req.outputs[0].shm_region == "r"
    assert len(planned) == 1
    assert len(PLANS) == 1
    # With its values inline, a plain JSON request is planned once per form, its values (and
    # its id) read from each request.
    for i, value in enumerate((1.5, -3.0, 7.25)):
        doc = {"id": f"r{i}", "inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [value]}]}
        req = decode_infer(orjson.dumps(doc))
        assert req.inputs["x"][0] == value and req.id == f"r{i}"
    assert len(planned) == 2
    assert len(PLANS) == 2
    PLANS.clear()


def test_a_cached_header_is_still_counted_against_each_models_limits() -> None:
    """Whoever cached a header, a model with fewer inputs refuses one holding more JSON objects
    than its requests can (the count that bounds parsing is not skipped on a cache hit)."""
    PLANS.clear()
    shm = {"shared_memory_region": "r", "shared_memory_byte_size": 4}
    # 700 objects in 4-8 KiB: cacheable, and refused by a small model
    many: dict[str, object] = {f"k{i}": {} for i in range(700)}
    body = orjson.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "parameters": {**shm, **many}}]})
    assert 4096 < len(body) <= 8192
    region = bytearray(4)
    small = Limits(1, 1, "small")
    for _ in range(2):  # refused before and after another model has cached it
        with pytest.raises(InvalidInputError, match="more JSON objects"):
            decode_infer(body, None, lambda n, o, s: memoryview(region)[o : o + s], limits=small)
        decode_infer(body, None, lambda n, o, s: memoryview(region)[o : o + s])
        assert len(PLANS) == 1
    PLANS.clear()


def test_a_plain_json_request_with_a_bad_id_reports_its_errors_in_the_usual_order() -> None:
    PLANS.clear()
    with pytest.raises(BadRequestError, match="'inputs' must be a non-empty list"):
        decode_infer(orjson.dumps({"id": None, "inputs": []}))
    with pytest.raises(BadRequestError, match="'id' must be a string"):
        decode_infer(
            orjson.dumps({"id": None, "inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]})
        )
    PLANS.clear()
