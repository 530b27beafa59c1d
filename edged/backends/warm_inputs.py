"""Warm-up inputs: random tensors at the profile's optimal shape, a sample file, or inputs
given one by one (a shape each, and zeros, random data or a file of the tensor's raw bytes: a
Triton model_warmup sample).

Random data is enough to page in weights, build kernels' caches and start thread pools; a model
whose work depends on the data (detection post-processing, early exits) should be warmed with a
real sample file. The daemon warms every model with them (edged/serving/warmup.py), and the
build child times the candidates of ``precision = "auto"`` on them (edged/quantize/auto.py): the
shapes a model serves at are the shapes its precision is chosen at.
"""

from __future__ import annotations

import numpy as np

from edged.backends.base import TensorSpec
from edged.config import ModelConfig, WarmupInput
from edged.errors import ConfigError, EdgedError
from edged.wire.tensors import from_bytes

# A dynamic dimension with no profile: batch 1, and a small spatial size that every
# convolutional model accepts (a multiple of 32).
_DEFAULT_BATCH, _DEFAULT_DIM = 1, 64


def concrete_shape(spec: TensorSpec, model: ModelConfig) -> tuple[int, ...]:
    given = model.warmup.inputs
    if isinstance(given, dict) and spec.name in given:
        return tuple(given[spec.name].shape)
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
    if dtype.kind == "O":
        # BYTES: text every string model reads, and a number for those that parse one (Triton's
        # string examples do, and a repository without model_warmup must still come up warm).
        return np.full(shape, b"0", dtype=object)
    return np.zeros(shape, dtype=dtype)


def warm_inputs(specs: tuple[TensorSpec, ...], model: ModelConfig) -> dict[str, np.ndarray]:
    source = model.warmup.inputs
    if isinstance(source, dict):
        return _given(source, specs)
    if source != "random":
        return _from_file(source, specs)
    rng = np.random.default_rng(0)
    return {s.name: random_tensor(s, concrete_shape(s, model), rng) for s in specs}


def _given(inputs: dict[str, WarmupInput], specs: tuple[TensorSpec, ...]) -> dict[str, np.ndarray]:
    missing = [s.name for s in specs if s.name not in inputs]
    unknown = sorted(set(inputs) - {s.name for s in specs})
    if missing or unknown:
        raise ConfigError(f"warm-up inputs {sorted(inputs)} are not the model's inputs {[s.name for s in specs]}")
    rng = np.random.default_rng(0)
    out = {}
    for spec in specs:
        given = inputs[spec.name]
        shape = tuple(given.shape)
        if given.file:
            out[spec.name] = _raw_file(given.file, spec, shape)
        elif given.data == "zero":
            out[spec.name] = (
                np.full(shape, b"", dtype=object) if spec.np_dtype.kind == "O" else np.zeros(shape, spec.np_dtype)
            )
        else:
            out[spec.name] = random_tensor(spec, shape, rng)
    return out


def _raw_file(path: str, spec: TensorSpec, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor from a file of its raw bytes, row-major (BYTES: length-prefixed elements)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(f"warm-up input '{spec.name}': cannot read {path}: {e.strerror}") from None
    try:
        return from_bytes(data, spec.np_dtype, shape, f"warm-up input '{spec.name}' ({path})")
    except EdgedError as e:
        raise ConfigError(e.message) from None


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
