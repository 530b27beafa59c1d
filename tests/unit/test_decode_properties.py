"""Property tests of the request decoders (hypothesis, bounded examples): whatever a client
sends -- JSON infer bodies, the binary tensor extension, shared memory parameters, header
values -- the decoder returns a request or raises an EdgedError with a 4xx status, never
anything else. A valid request decodes to exactly the tensors it describes."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from edged.errors import BadRequestError, EdgedError, SharedMemoryError
from edged.wire.decode import V2_TO_NUMPY, Limits, decode_infer, encode_infer, parse_header_length
from edged.wire.tensors import tensor_bytes, tensor_bytes_copy

# pytest resets warning filters per test; the daemon's own filter (edged.wire.tensors) hides this one.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

DATATYPES = [*V2_TO_NUMPY, "BYTES", "FP8", "", "fp32"]
# Values a JSON document can hold, kept within what orjson can write (64-bit integers).
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=12,
)
dims = st.one_of(st.integers(min_value=0, max_value=6), st.integers(min_value=-3, max_value=2**62), st.booleans())
shm_keys = ["shared_memory_region", "shared_memory_byte_size", "shared_memory_offset"]
param_values = st.one_of(json_values, st.integers(min_value=-5, max_value=64), st.sampled_from(["r", ""]))
parameters = st.dictionaries(
    st.sampled_from([*shm_keys, "binary_data_size", "binary_data", "binary_data_output", "other"]),
    param_values,
    max_size=4,
)


@st.composite
def inputs(draw: st.DrawFn) -> dict[str, Any]:
    inp: dict[str, Any] = {}
    if draw(st.booleans()):
        inp["name"] = draw(st.sampled_from(["x", "y", ""]) | json_values)
    if draw(st.integers(0, 9)):
        inp["shape"] = draw(st.lists(dims, max_size=4) | json_values)
    if draw(st.integers(0, 9)):
        inp["datatype"] = draw(st.sampled_from(DATATYPES) | json_values)
    if draw(st.booleans()):
        inp["data"] = draw(json_values | st.lists(st.integers(-300, 300) | st.floats(allow_nan=False), max_size=40))
    if draw(st.booleans()):
        inp["parameters"] = draw(parameters | json_values)
    return inp


@st.composite
def documents(draw: st.DrawFn) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    if draw(st.integers(0, 9)):
        doc["inputs"] = draw(st.lists(inputs(), max_size=3) | json_values)
    if draw(st.booleans()):
        outs = st.fixed_dictionaries(
            {"name": st.sampled_from(["y", "x", ""]) | json_values}, optional={"parameters": parameters}
        )
        doc["outputs"] = draw(st.lists(outs, max_size=3) | json_values)
    if draw(st.booleans()):
        doc["parameters"] = draw(parameters | json_values)
    if draw(st.booleans()):
        doc["id"] = draw(json_values)
    return doc


def resolver(name: str, offset: int, size: int) -> memoryview:
    """A registry with one 64-byte region 'r', as the transports' resolvers behave."""
    if name != "r":
        raise SharedMemoryError(f"shared memory region '{name}' is not registered")
    if offset + size > 64:
        raise SharedMemoryError(f"region '{name}' is 64 bytes; {offset}+{size} is past its end")
    return memoryview(bytearray(64))[offset : offset + size]


def decodes_or_4xx(body: bytes, header_length: int | None = None, limits: Limits | None = None) -> None:
    try:
        req = decode_infer(body, header_length, resolver, limits or Limits())
    except EdgedError as e:
        assert 400 <= e.http_status < 500, (type(e).__name__, e.message)
        return
    for name, arr in req.inputs.items():
        assert isinstance(name, str) and name
        assert isinstance(arr, np.ndarray)


@SETTINGS
@given(documents())
@example({"inputs": [{"name": "x", "shape": [0, 2**62, 2**62], "datatype": "FP32", "data": []}]})
@example({"inputs": [{"name": "x", "shape": [2], "datatype": "UINT8", "data": [1, 2**64 - 1]}]})
@example({"inputs": [{"name": "x", "shape": [1], "datatype": "BOOL", "data": [{"a": 1}]}]})
@example({"inputs": [{"name": "x", "shape": [], "datatype": "FP16", "data": 1e300}]})
def test_any_json_document_decodes_or_is_a_4xx(doc: dict[str, Any]) -> None:
    decodes_or_4xx(orjson.dumps(doc))


@SETTINGS
@given(st.binary(max_size=300))
def test_any_bytes_decode_or_are_a_4xx(body: bytes) -> None:
    decodes_or_4xx(body)
    decodes_or_4xx(body, len(body) // 2)


@SETTINGS
@given(documents(), st.binary(max_size=64), st.integers(min_value=-2, max_value=400))
def test_binary_extension_with_any_tail_and_length(doc: dict[str, Any], tail: bytes, shift: int) -> None:
    header = orjson.dumps(doc)
    header_length = max(0, len(header) + shift) if shift != -2 else 0
    decodes_or_4xx(header + tail, header_length)


def sample(dtype: str, shape: list[int], mod: int) -> np.ndarray:
    """A tensor of ``dtype``; BYTES elements of varying length (empty ones too)."""
    values = np.arange(math.prod(shape)) % mod
    if dtype == "BYTES":
        return np.array([b"\xc3\xa9" * int(v) for v in values] + [b""], dtype=object)[:-1].reshape(shape)
    return values.astype(V2_TO_NUMPY[dtype]).reshape(shape)


def _valid_request(shape: list[int], dtype: str, mode: str) -> tuple[bytes, int | None, np.ndarray]:
    arr = sample(dtype, shape, 7)
    inp: dict[str, Any] = {"name": "x", "shape": shape, "datatype": dtype}
    if mode == "json":
        flat = arr.reshape(-1).tolist()
        inp["data"] = [v.decode() for v in flat] if dtype == "BYTES" else flat
        return orjson.dumps({"inputs": [inp]}), None, arr
    raw = bytes(tensor_bytes(arr))
    inp["parameters"] = {"binary_data_size": len(raw)}
    header = orjson.dumps({"inputs": [inp]})
    return header + raw, len(header), arr


@SETTINGS
@given(
    st.lists(st.integers(0, 5), max_size=4),
    st.sampled_from(sorted(V2_TO_NUMPY)),
    st.sampled_from(["json", "binary"]),
)
def test_valid_requests_decode_to_exactly_their_tensors(shape: list[int], dtype: str, mode: str) -> None:
    body, header_length, arr = _valid_request(shape, dtype, mode)
    got = decode_infer(body, header_length).inputs["x"]
    assert got.dtype == arr.dtype and got.shape == arr.shape
    np.testing.assert_array_equal(got, arr)


@SETTINGS
@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=3),
    st.sampled_from(sorted(V2_TO_NUMPY)),
    st.sampled_from(["json", "binary"]),
    st.lists(
        st.tuples(st.integers(0, 10_000), st.integers(0, 255), st.sampled_from(["flip", "insert", "delete"])),
        max_size=4,
    ),
)
def test_mutated_valid_requests_decode_or_are_a_4xx(
    shape: list[int], dtype: str, mode: str, edits: list[tuple[int, int, str]]
) -> None:
    body, header_length, _ = _valid_request(shape, dtype, mode)
    buf = bytearray(body)
    for pos, byte, op in edits:
        at = pos % (len(buf) + 1)
        if op == "insert":
            buf.insert(at, byte)
        elif buf and op == "delete":
            del buf[min(at, len(buf) - 1)]
        elif buf:
            buf[min(at, len(buf) - 1)] ^= byte or 1
    decodes_or_4xx(bytes(buf), header_length)
    decodes_or_4xx(bytes(buf), header_length, Limits(1, 1, "m", json_bytes=64))


@SETTINGS
@given(parameters, st.sampled_from(sorted(V2_TO_NUMPY)), st.lists(st.integers(0, 9), max_size=3))
def test_shared_memory_parameters_decode_or_are_a_4xx(params: dict[str, Any], dtype: str, shape: list[int]) -> None:
    doc: dict[str, object] = {"inputs": [{"name": "x", "shape": shape, "datatype": dtype, "parameters": params}]}
    decodes_or_4xx(orjson.dumps(doc))
    out = {"name": "y", "parameters": params}
    doc = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}], "outputs": [out]}
    decodes_or_4xx(orjson.dumps(doc))


@SETTINGS
@given(st.one_of(st.text(max_size=25), st.binary(max_size=25), st.integers(0, 10**18).map(str)))
def test_header_length_is_a_plain_decimal_or_a_400(raw: str | bytes) -> None:
    try:
        value = parse_header_length(raw)
    except BadRequestError as e:
        assert e.http_status == 400
        return
    text = raw.decode("latin-1") if isinstance(raw, bytes) else raw
    assert text.isascii() and text.isdigit() and int(text) == value


@SETTINGS
@given(
    st.dictionaries(
        st.sampled_from(["a", "b", "c"]),
        st.sampled_from(sorted(V2_TO_NUMPY)).flatmap(
            lambda dt: st.lists(st.integers(0, 3), max_size=3).map(lambda s: sample(dt, s, 5))
        ),
        min_size=1,
    ),
    st.booleans(),
)
def test_encoded_responses_read_back(results: dict[str, np.ndarray], binary: bool) -> None:
    from edged.client import decode_response
    from edged.wire.decode import InferRequest

    body, header_length = encode_infer("m", InferRequest(binary_all=binary), results)
    back = decode_response(body, header_length)
    assert set(back) == set(results)
    for name, arr in results.items():
        want = arr.astype(np.float32) if arr.dtype == np.float16 and not binary else arr
        np.testing.assert_array_equal(back[name].reshape(arr.shape), want)


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4).T,  # not contiguous: the wire is row-major
        np.arange(6, dtype=">i4").reshape(2, 3),
        np.zeros((0, 3), np.float16),
        np.array([[b"a", b""], [b"\x00bc", b"d"]], dtype=object),
    ],
)
def test_the_copy_of_a_tensors_bytes_is_its_wire_form(arr: np.ndarray) -> None:
    assert tensor_bytes_copy(arr) == bytes(tensor_bytes(arr))


@pytest.mark.parametrize("n", [1, 3])
def test_limits_hold_for_generated_floods(n: int) -> None:
    """Named-tensor floods are refused whatever their content (the property tests above use
    small lists; this is the large end)."""
    doc = {"inputs": [{"name": f"x{i}", "shape": [1], "datatype": "FP32", "data": [0]} for i in range(5000)]}
    with pytest.raises(EdgedError) as err:
        decode_infer(orjson.dumps(doc), limits=Limits(n, n, "m"))
    assert err.value.http_status == 400
