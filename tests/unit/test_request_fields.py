"""Request fields read strictly: BYTES data nested deeper than its shape, and boolean fields of the
generation routes given as anything but true or false, are 400s rather than guesses."""

from __future__ import annotations

from typing import Any

import pytest

from edged.errors import BadRequestError
from edged.transports.http.openai import _flag
from edged.wire.tensors import from_json_data, parse_dtype

BYTES = parse_dtype("BYTES", "x")


@pytest.mark.parametrize(
    ("data", "shape"),
    [([["a"], ["b"]], (2,)), ([[["a"]], [["b"]]], (2, 1)), ([["a"]], (1,))],
)
def test_bytes_data_nested_deeper_than_its_shape_is_refused(data: Any, shape: tuple[int, ...]) -> None:
    with pytest.raises(BadRequestError, match="nested deeper than shape"):
        from_json_data(data, BYTES, shape, "x")


@pytest.mark.parametrize(
    ("data", "shape"),
    [(["a", "b"], (2,)), ([["a", "b"], ["c", "d"]], (2, 2)), (["a", "b", "c", "d"], (2, 2)), ("a", ())],
)
def test_bytes_data_flat_or_nested_as_its_shape_is_read(data: Any, shape: tuple[int, ...]) -> None:
    assert from_json_data(data, BYTES, shape, "x").shape == shape


@pytest.mark.parametrize("value", ["yes", 1, "true", [], {}])
def test_a_boolean_field_that_is_not_a_boolean_is_refused(value: Any) -> None:
    with pytest.raises(BadRequestError, match="'stream' must be true or false"):
        _flag({"stream": value}, "stream")


def test_a_boolean_field_absent_or_null_is_false() -> None:
    assert _flag({}, "stream") is False and _flag({"stream": None}, "stream") is False
    assert _flag({"stream": True}, "stream") is True
