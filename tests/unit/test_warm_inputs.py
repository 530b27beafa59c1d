"""The warm-up inputs edged makes up for a model whose configuration gives none."""

from __future__ import annotations

import numpy as np

from edged.backends.base import TensorSpec
from edged.serving.warmup import random_tensor


def test_made_up_text_reads_as_text_and_as_a_number() -> None:
    # Triton's string models parse their BYTES inputs as integers: a repository without
    # model_warmup still comes up warm on them.
    spec = TensorSpec("INPUT0", "object", (-1, 16))
    tensor = random_tensor(spec, (1, 16), np.random.default_rng(0))
    assert tensor.shape == (1, 16)
    assert tensor.dtype == object
    assert all(int(v) == 0 for v in tensor.ravel())
    assert all(v.decode("utf-8").isprintable() for v in tensor.ravel())
