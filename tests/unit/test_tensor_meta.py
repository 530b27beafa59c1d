"""edged/wire/tensors.py: the V2 datatype remembered per dtype, and a planned output's copy."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from edged.wire import tensors
from edged.wire.tensors import OutputRequest, datatype_of, v2_datatype

NAMES = "bool uint8 uint16 uint32 uint64 int8 int16 int32 int64 float16 float32 float64 <f4 >f4 object S7 U3"
DTYPES = [np.dtype(t) for t in NAMES.split()]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_datatype_of_answers_what_the_dtype_name_gives(dtype: np.dtype[Any]) -> None:
    want = v2_datatype(dtype.name)
    assert datatype_of(dtype) == want
    assert datatype_of(dtype) == want  # from the table the second time


def test_the_datatype_table_is_bounded() -> None:
    saved = dict(tensors._DATATYPES)
    try:
        tensors._DATATYPES.clear()
        # Structured dtypes: each a distinct key, as a hostile model's outputs could be.
        for i in range(tensors._DATATYPES_MAX * 3):
            dt = np.dtype([(f"f{i}", np.int32)])
            assert datatype_of(dt) == v2_datatype(dt.name)
        assert len(tensors._DATATYPES) == tensors._DATATYPES_MAX
    finally:
        tensors._DATATYPES.clear()
        tensors._DATATYPES.update(saved)


def test_an_output_copy_keeps_every_field_and_is_its_own() -> None:
    # Every field set to a value other than its default: a field added later and left out of
    # copy() fails here.
    values: dict[str, Any] = {"name": "y", "binary": True, "shm_region": "r", "shm_offset": 8, "shm_size": 64}
    assert {f.name for f in dataclasses.fields(OutputRequest)} == set(values)
    planned = OutputRequest(**values)
    copy = planned.copy()
    assert copy == planned and copy is not planned
    copy.shm_offset = 16
    assert planned.shm_offset == 8
