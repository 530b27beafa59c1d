"""Shapes, types and sizes of an engine's I/O tensors: pure functions, tested without TensorRT.

Buffers are sized once, for the largest shape an optimisation profile admits, so a request never
allocates: a dynamic input takes its profile's ``max``, an output the shape TensorRT reports with
every input at its maximum.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from edged.errors import BuildError

Shape = tuple[int, ...]
Profile = tuple[Shape, Shape, Shape]  # min, opt, max

# TensorRT DataType member names → numpy dtype names. Names, not members, so the table holds for
# every version (8.5 has no INT64, 11 may drop others) and is testable without TensorRT.
TRT_DTYPES: dict[str, str] = {
    "FLOAT": "float32",
    "HALF": "float16",
    "INT8": "int8",
    "INT32": "int32",
    "INT64": "int64",
    "BOOL": "bool",
    "UINT8": "uint8",
}


def numpy_dtype(trt_name: str, tensor: str) -> str:
    try:
        return TRT_DTYPES[trt_name]
    except KeyError:
        raise ValueError(
            f"tensor {tensor!r} has TensorRT type {trt_name}, which has no numpy equivalent; "
            "give the model float32/float16/int8/int32/int64/bool/uint8 inputs and outputs"
        ) from None


class DimsLike(Protocol):
    """TensorRT's ``Dims`` as far as reading it goes (a tuple qualifies too)."""

    def __len__(self) -> int: ...
    def __getitem__(self, index: int, /) -> int: ...


def dims(shape: DimsLike) -> Shape:
    return tuple(int(shape[i]) for i in range(len(shape)))


def is_dynamic(shape: Iterable[int]) -> bool:
    return any(d < 0 for d in shape)


def resolve_profiles(inputs: Sequence[tuple[str, Shape]], profiles: Mapping[str, Profile]) -> dict[str, Profile]:
    """The optimisation profile to give the builder, checked against the network's inputs.

    Every input with a dynamic dimension needs a profile; a profile must name a real input, have
    the input's rank and agree with its fixed dimensions.
    """
    shapes = dict(inputs)
    unknown = sorted(set(profiles) - set(shapes))
    if unknown:
        raise BuildError(
            f"profiles name inputs the model does not have: {', '.join(unknown)} (inputs: {', '.join(shapes)})"
        )
    resolved: dict[str, Profile] = {}
    for name, shape in inputs:
        prof = profiles.get(name)
        if prof is None:
            if is_dynamic(shape):
                raise BuildError(
                    f"input {name!r} has dynamic shape {_fmt(shape)}: add a profile "
                    f"[models.NAME.profiles.{name}] with min, opt and max"
                )
            continue
        _check_profile(name, shape, prof)
        resolved[name] = (tuple(prof[0]), tuple(prof[1]), tuple(prof[2]))
    return resolved


def _check_profile(name: str, shape: Shape, prof: Profile) -> None:
    lo, opt, hi = prof
    if not len(lo) == len(opt) == len(hi) == len(shape):
        raise BuildError(
            f"profile of {name!r}: the input has rank {len(shape)} "
            f"({_fmt(shape)}), the profile gives {len(lo)}/{len(opt)}/{len(hi)}"
        )
    for i, (want, a, b, c) in enumerate(zip(shape, lo, opt, hi)):
        if not 0 < a <= b <= c:
            raise BuildError(f"profile of {name!r}, dim {i}: needs 0 < min <= opt <= max")
        if want >= 0 and not want == a == b == c:
            raise BuildError(f"profile of {name!r}, dim {i}: the model fixes it at {want}")


def max_shape(name: str, shape: Shape, profile_max: Shape | None) -> Shape:
    """The largest shape a buffer for this tensor must hold."""
    if not is_dynamic(shape):
        return shape
    if profile_max is None or len(profile_max) != len(shape) or is_dynamic(profile_max):
        raise ValueError(
            f"tensor {name!r} ({_fmt(shape)}) has no bounded maximum shape; "
            "TensorRT reports data-dependent outputs, which edged does not run"
        )
    return tuple(profile_max)


@dataclass(frozen=True)
class TensorPlan:
    """One I/O tensor's buffer: sized for its largest shape, never reallocated."""

    name: str
    dtype: str
    max_shape: Shape
    is_input: bool

    @property
    def max_elements(self) -> int:
        return math.prod(self.max_shape)

    @property
    def nbytes(self) -> int:
        return self.max_elements * np.dtype(self.dtype).itemsize


def io_bytes(plans: Iterable[TensorPlan], mapped: bool) -> int:
    """Bytes one instance holds: page-locked host buffers, plus device buffers unless the host
    buffers are mapped into the GPU's address space (Jetson's unified memory)."""
    host = sum(max(1, p.nbytes) for p in plans)
    return host if mapped else 2 * host


def _fmt(shape: Iterable[int]) -> str:
    return "[" + ",".join("?" if d < 0 else str(d) for d in shape) + "]"


def narrow_int64(name: str, arr: np.ndarray) -> np.ndarray:
    """An INT64 array for an input TensorRT 8.x's ONNX parser made INT32, as INT32; values that
    INT32 cannot hold are refused rather than wrapped."""
    info = np.iinfo(np.int32)
    if arr.size and (int(arr.min()) < info.min or int(arr.max()) > info.max):
        raise ValueError(
            f"input '{name}' holds values outside int32, the type TensorRT 8.x gives this input (its ONNX parser "
            "turns INT64 inputs into INT32)"
        )
    return arr.astype(np.int32)
