"""edged/wire/validate.py: the one owner of a model's input rules."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from edged.backends.base import TensorSpec
from edged.errors import InvalidInputError
from edged.wire.validate import InputRule, InputRules, rules_of

SPECS = (TensorSpec("images", "float32", (-1, 3, -1, -1)), TensorSpec("text", "object", (-1,)))
RULES = rules_of(SPECS, {"images": ((1, 3, 32, 32), (8, 3, 640, 640))})


def inputs(n: int = 2, side: int = 64, dtype: type = np.float32) -> dict[str, np.ndarray]:
    return {"images": np.zeros((n, 3, side, side), dtype), "text": np.array([b"a"] * n, dtype=object)}


def test_a_request_that_fits_passes() -> None:
    RULES.check(inputs())


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"images": inputs()["images"]}, r"expected inputs \[images, text\], got \[images\]"),
        ({**inputs(), "extra": np.zeros(1)}, r"got \[images, text, extra\]"),
        ({"images": inputs()["images"], "txt": inputs()["text"]}, r"got \[images, txt\]"),
        (inputs(dtype=np.float64), "input 'images': expected datatype FP32, got FP64"),
        ({**inputs(), "text": np.zeros(2, np.int64)}, "input 'text': expected datatype BYTES, got INT64"),
        (
            {**inputs(), "images": np.zeros((2, 1, 64, 64), np.float32)},
            r"expected shape \[-1, 3, -1, -1\], got \[2, 1, 64, 64\]",
        ),
        ({**inputs(), "images": np.zeros((2, 3, 64), np.float32)}, "expected shape"),
        (inputs(side=16), r"outside the profile \[1, 3, 32, 32\]..\[8, 3, 640, 640\] \(dim 2 is 16, not 32..640\)"),
    ],
)
def test_each_fault_says_what_was_expected(given: dict[str, np.ndarray], message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        RULES.check(given)


def test_the_config_narrows_the_backend_rules_and_the_stricter_bound_wins() -> None:
    rules = RULES.narrowed("det", {"images": ((1, 3, 64, 64), (4, 3, 1280, 320))}, max_batch=3)
    rules.check(inputs(n=3, side=64))
    with pytest.raises(InvalidInputError, match=r"model 'det' takes inputs \[images, text\]"):
        rules.check({"images": inputs()["images"]})
    # lows: the config's 64 over the engine's 32; highs: the engine's 8 and 640 where they are lower
    with pytest.raises(InvalidInputError, match=r"\[1, 3, 64, 64\]..\[4, 3, 640, 320\] \(dim 3 is 400"):
        rules.check({**inputs(), "images": np.zeros((1, 3, 64, 400), np.float32)})
    with pytest.raises(InvalidInputError, match=r"\(dim 2 is 700, not 64..640\)"):
        rules.check({**inputs(), "images": np.zeros((1, 3, 700, 64), np.float32)})
    with pytest.raises(InvalidInputError, match="input 'text': batch 4 > max_batch 3"):
        rules.check({"images": inputs(n=4)["images"][:1], "text": inputs(n=4)["text"]})


def test_a_bound_of_another_rank_is_not_applied() -> None:
    rules = RULES.narrowed("m", {"text": ((1, 1), (2, 2))}, max_batch=1)
    rules.check(inputs(n=5))  # the config's profile does not describe this input: ignored here
    assert InputRules(()).names == frozenset()


_dims = st.integers(min_value=-1, max_value=4)


@given(
    shape=st.lists(_dims, min_size=0, max_size=4),
    got=st.lists(st.integers(min_value=0, max_value=4), min_size=0, max_size=5),
    bounded=st.booleans(),
)
def test_the_fast_shape_test_agrees_with_the_full_one(shape: list[int], got: list[int], bounded: bool) -> None:
    lo, hi = tuple(1 for _ in shape), tuple(3 for _ in shape)
    rule = InputRule("x", np.dtype(np.float32), tuple(shape), (lo, hi) if bounded else None)
    assert rule.fits(tuple(got)) == (rule.shape_error(tuple(got)) == "")


def test_narrowing_keeps_the_fast_test_right() -> None:
    rules = rules_of([TensorSpec("x", "float32", (-1, 16))]).narrowed("m", {"x": ((1, 16), (4, 16))}, 1)
    assert rules.rules[0].fits((4, 16)) and not rules.rules[0].fits((5, 16))
