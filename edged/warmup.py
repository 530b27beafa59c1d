"""Warm-up inputs: random tensors at the profile's optimal shape, or a sample file.

Random data is enough to page in weights, build kernels' caches and start thread pools; a model
whose work depends on the data (detection post-processing, early exits) should be warmed with a
real sample file.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from edged.backends.base import TensorSpec
from edged.config import ModelConfig
from edged.errors import ConfigError

log = logging.getLogger(__name__)

# A dynamic dimension with no profile: batch 1, and a small spatial size that every
# convolutional model accepts (a multiple of 32).
_DEFAULT_BATCH, _DEFAULT_DIM = 1, 64


def concrete_shape(spec: TensorSpec, model: ModelConfig) -> tuple[int, ...]:
    profile = model.profiles.get(spec.name)
    if profile is not None:
        return tuple(profile.opt)
    return tuple(d if d >= 0 else (_DEFAULT_BATCH if i == 0 else _DEFAULT_DIM) for i, d in enumerate(spec.shape))


def random_tensor(spec: TensorSpec, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    dtype = spec.np_dtype
    if dtype.kind == "f":
        return rng.random(shape, dtype=np.float32).astype(dtype, copy=False)
    if dtype.kind in "iu":
        return rng.integers(0, 2, size=shape).astype(dtype)
    if dtype.kind == "O":  # BYTES: text every string model can read
        return np.full(shape, b"edged", dtype=object)
    return np.zeros(shape, dtype=dtype)


def warm_inputs(specs: tuple[TensorSpec, ...], model: ModelConfig) -> dict[str, np.ndarray]:
    source = model.warmup.inputs
    if source != "random":
        return _from_file(source, specs)
    rng = np.random.default_rng(0)
    return {s.name: random_tensor(s, concrete_shape(s, model), rng) for s in specs}


def _from_file(path: str, specs: tuple[TensorSpec, ...]) -> dict[str, np.ndarray]:
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ConfigError(f"warm-up sample {path} is not a .npy/.npz file: {e}") from None
    if isinstance(data, np.lib.npyio.NpzFile):
        with data:
            missing = [s.name for s in specs if s.name not in data.files]
            if missing:
                raise ConfigError(f"warm-up sample {path} has no array for inputs {missing}")
            return {s.name: np.asarray(data[s.name], dtype=s.np_dtype) for s in specs}
    if len(specs) != 1:
        raise ConfigError(f"warm-up sample {path} is a single array; the model has {len(specs)} inputs")
    return {specs[0].name: np.asarray(data, dtype=specs[0].np_dtype)}


# Work a request may do on the event loop: the inline path is for requests whose run costs about
# as much as the hand-off to a worker, never for one that holds every other client up.
INLINE_BUDGET_US = 1000.0


def inline_max_elements(specs: tuple[TensorSpec, ...], model: ModelConfig, infer_us: float) -> int:
    """The most input elements a request to an inline model may have and still run on the loop:
    the warm-up's element count, scaled (linearly, which overestimates the cost of a small
    model's larger request) to what fits in INLINE_BUDGET_US given the measured run time."""
    warm = sum(math.prod(concrete_shape(s, model)) for s in specs)
    return max(warm, int(warm * INLINE_BUDGET_US / max(infer_us, 1.0)))
