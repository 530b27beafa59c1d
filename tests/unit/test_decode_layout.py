"""The decode of a request whose inputs are all numeric tensors in the binary part, laid out once
per plan (``RequestPlan.layout``): the same tensors and errors as the per-input path."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest

from edged.errors import BadRequestError
from edged.wire.decode import decode_infer
from edged.wire.plans import plan_document
from edged.wire.validate import Limits

LIMITS = Limits()


def _binary(arrays: dict[str, np.ndarray], **extra: Any) -> tuple[bytes, int]:
    doc: dict[str, Any] = {
        "inputs": [
            {
                "name": n,
                "datatype": "FP32" if a.dtype == np.float32 else "INT64",
                "shape": list(a.shape),
                "parameters": {"binary_data_size": a.nbytes},
            }
            for n, a in arrays.items()
        ],
        **extra,
    }
    header = orjson.dumps(doc)
    return header + b"".join(a.tobytes() for a in arrays.values()), len(header)


def test_binary_numeric_inputs_decode_to_their_tensors_through_the_layout() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([[7, 8]], dtype=np.int64)
    body, hl = _binary({"a": a, "b": b})
    for _ in range(2):  # planned, then from the plan cache
        req = decode_infer(body, hl, None, LIMITS)
        assert list(req.inputs) == ["a", "b"]
        np.testing.assert_array_equal(req.inputs["a"], a)
        np.testing.assert_array_equal(req.inputs["b"], b)
        assert req.inputs["a"].dtype == np.float32 and req.inputs["b"].shape == (1, 2)
        assert req.inputs["a"].base is not None  # a view of the body, not a copy


def test_the_layout_is_made_only_for_binary_numeric_inputs_of_their_own_size() -> None:
    def layout(inp: dict[str, Any]) -> Any:
        return plan_document({"inputs": [inp]}, LIMITS).layout

    binary = {"name": "x", "datatype": "FP32", "shape": [2, 2], "parameters": {"binary_data_size": 16}}
    assert layout(binary) == (("x", np.dtype(np.float32), (2, 2), 0, 16),)
    assert layout({**binary, "parameters": {"binary_data_size": 12}}) is None  # the per-input path says why
    assert layout({"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}) is None
    assert layout({"name": "x", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 5}}) is None
    shm = {"shared_memory_region": "r", "shared_memory_byte_size": 16}
    assert layout({"name": "x", "datatype": "FP32", "shape": [2, 2], "parameters": shm}) is None


def test_a_body_of_the_wrong_length_gets_the_per_input_error() -> None:
    a = np.ones((1, 4), np.float32)
    body, hl = _binary({"a": a})
    decode_infer(body, hl, None, LIMITS)  # the plan, cached
    with pytest.raises(BadRequestError, match="4 bytes of binary data belong to no input"):
        decode_infer(body + b"\0" * 4, hl, None, LIMITS)
    with pytest.raises(BadRequestError, match="runs past the end of the binary data"):
        decode_infer(body[:-4], hl, None, LIMITS)


def test_outputs_to_shared_memory_still_need_a_transport_with_it() -> None:
    a = np.ones((1, 4), np.float32)
    outputs = [{"name": "y", "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 16}}]
    body, hl = _binary({"a": a}, outputs=outputs)
    with pytest.raises(BadRequestError, match="shared memory is not available"):
        decode_infer(body, hl, None, LIMITS)

    def resolver(region: str, offset: int, size: int) -> memoryview:
        return memoryview(bytearray(size))

    req = decode_infer(body, hl, resolver, LIMITS)  # the layout path keeps the outputs' regions
    assert req.outputs is not None and req.outputs[0].shm_region == "r"


def test_zero_sized_and_unaligned_inputs_decode_through_the_layout() -> None:
    empty = np.zeros((0, 3), np.float32)
    a = np.arange(4, dtype=np.int64).reshape(1, 4)
    body, hl = _binary({"e": empty, "a": a})
    for pad in range(1, 4):  # the binary part starting at odd offsets of the body
        header = body[:hl] + b" " * pad
        req = decode_infer(header + body[hl:], len(header), None, LIMITS)
        assert req.inputs["e"].shape == (0, 3)
        np.testing.assert_array_equal(req.inputs["a"], a)


def test_a_cached_plan_is_checked_against_each_models_limits() -> None:
    a, b = np.ones((1, 2), np.float32), np.ones((1, 3), np.float32)
    body, hl = _binary({"a": a, "b": b})
    decode_infer(body, hl, None, LIMITS)  # planned and cached under the default limits
    narrow = Limits(inputs=1, outputs=1, model="m")
    with pytest.raises(BadRequestError, match="lists 2 inputs"):
        decode_infer(body, hl, None, narrow)
    # Found within the default limits again, then within the narrow ones again: each model's
    # limits are checked, whichever a plan was last found within (it remembers only that one).
    for _ in range(2):
        assert decode_infer(body, hl, None, LIMITS).inputs.keys() == {"a", "b"}
        assert decode_infer(body, hl, None, LIMITS).inputs.keys() == {"a", "b"}
        with pytest.raises(BadRequestError, match="lists 2 inputs"):
            decode_infer(body, hl, None, narrow)
