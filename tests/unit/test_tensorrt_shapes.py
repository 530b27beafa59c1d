"""Profiles, dtypes and buffer sizing of the TensorRT backend, without TensorRT."""

from __future__ import annotations

import numpy as np
import pytest

from edged.backends.tensorrt.shapes import (
    TensorPlan,
    io_bytes,
    max_shape,
    numpy_dtype,
    resolve_profiles,
)
from edged.errors import BuildError

IMAGE = ("images", (-1, 3, -1, -1))
PROFILE = ((1, 3, 32, 32), (1, 3, 640, 640), (4, 3, 1280, 1280))


def test_dynamic_input_takes_its_profile() -> None:
    resolved = resolve_profiles([IMAGE, ("scale", (1,))], {"images": PROFILE})
    assert resolved == {"images": PROFILE}


def test_dynamic_input_without_profile_names_the_config_table() -> None:
    with pytest.raises(BuildError, match=r"profiles\.images"):
        resolve_profiles([IMAGE], {})


def test_profile_for_an_unknown_input_is_refused() -> None:
    with pytest.raises(BuildError, match="imgs"):
        resolve_profiles([IMAGE], {"images": PROFILE, "imgs": PROFILE})


@pytest.mark.parametrize(
    "profile, match",
    [
        (((1, 3, 32), (1, 3, 64), (1, 3, 64)), "rank 4"),
        (((1, 4, 32, 32), (1, 4, 64, 64), (1, 4, 64, 64)), "fixes it at 3"),
        (((1, 3, 64, 64), (1, 3, 32, 32), (1, 3, 64, 64)), "min <= opt <= max"),
        (((0, 3, 32, 32), (1, 3, 32, 32), (1, 3, 32, 32)), "0 < min"),
    ],
)
def test_bad_profiles_are_refused(profile: tuple[tuple[int, ...], ...], match: str) -> None:
    with pytest.raises(BuildError, match=match):
        resolve_profiles([IMAGE], {"images": profile})  # type: ignore[dict-item]


def test_static_input_may_carry_a_matching_profile() -> None:
    static = ((1, 16), (1, 16), (1, 16))
    assert resolve_profiles([("x", (1, 16))], {"x": static}) == {"x": static}


def test_max_shape_of_static_and_dynamic_tensors() -> None:
    assert max_shape("x", (1, 16), None) == (1, 16)
    assert max_shape("images", IMAGE[1], PROFILE[2]) == (4, 3, 1280, 1280)
    with pytest.raises(ValueError, match="data-dependent"):
        max_shape("boxes", (-1, 4), None)


def test_tensor_plan_sizes_for_the_maximum() -> None:
    plan = TensorPlan("images", "float16", (4, 3, 1280, 1280), True)
    assert plan.max_elements == 4 * 3 * 1280 * 1280
    assert plan.nbytes == plan.max_elements * 2
    out = TensorPlan("probs", "float32", (4, 1000), False)
    # Device buffers double the bytes unless the host buffers are mapped (unified memory).
    assert io_bytes([plan, out], mapped=False) == 2 * (plan.nbytes + out.nbytes)
    assert io_bytes([plan, out], mapped=True) == plan.nbytes + out.nbytes


def test_zero_sized_tensor_still_counts_one_byte() -> None:
    empty = TensorPlan("none", "float32", (0, 4), False)
    assert empty.nbytes == 0
    assert io_bytes([empty], mapped=True) == 1


def test_dtype_names_map_to_numpy() -> None:
    assert numpy_dtype("FLOAT", "x") == "float32"
    assert numpy_dtype("HALF", "x") == "float16"
    assert numpy_dtype("INT64", "x") == "int64"
    with pytest.raises(ValueError, match="BF16"):
        numpy_dtype("BF16", "x")


def test_dims_reads_any_indexable_shape() -> None:
    from edged.backends.tensorrt.shapes import dims

    class FakeDims:  # TensorRT's Dims: len() and indexing, no iteration guaranteed
        def __len__(self) -> int:
            return 3

        def __getitem__(self, i: int) -> int:
            return [-1, 3, 224][i]

    assert dims(FakeDims()) == (-1, 3, 224)
    assert dims((1, 16)) == (1, 16)


def test_int64_for_an_input_tensorrt_8_made_int32() -> None:
    from edged.backends.tensorrt.shapes import narrow_int64

    ids = np.array([[0, 7, 2**31 - 1, -(2**31)]], np.int64)
    out = narrow_int64("ids", ids)
    assert out.dtype == np.int32 and out.tolist() == ids.tolist()
    assert narrow_int64("ids", np.zeros((0, 4), np.int64)).dtype == np.int32
    with pytest.raises(ValueError, match="input 'ids' holds values outside int32"):
        narrow_int64("ids", np.array([2**31], np.int64))
