"""The request's tensor types, and tensors from untrusted request fields: shapes, datatypes,
JSON data and raw bytes.

Every check here runs before numpy allocates anything, and each costs time linear in what the
client actually sent (a request body is bounded by ``max_body``): a shape's element count is
bounded, JSON data must be laid out as the shape says before it is converted, and raw bytes
must match the shape exactly.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edged.errors import BadRequestError

V2_TO_NUMPY = {
    "BOOL": "bool",
    "UINT8": "uint8",
    "UINT16": "uint16",
    "UINT32": "uint32",
    "UINT64": "uint64",
    "INT8": "int8",
    "INT16": "int16",
    "INT32": "int32",
    "INT64": "int64",
    "FP16": "float16",
    "FP32": "float32",
    "FP64": "float64",
}
NUMPY_TO_V2 = {v: k for k, v in V2_TO_NUMPY.items()}

# (region name, offset, byte size) -> a writable view of exactly that many bytes.
ShmResolver = Callable[[str, int, int], memoryview]


@dataclass
class OutputRequest:
    name: str
    binary: bool = False
    shm_region: str | None = None
    shm_offset: int = 0
    shm_size: int = 0


@dataclass
class InferRequest:
    id: str = ""
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    outputs: list[OutputRequest] | None = None  # None: every output, as JSON unless binary_all
    binary_all: bool = False
    parameters: dict[str, Any] = field(default_factory=dict)


# A float in JSON data beyond float16/float32 becomes inf, as a C cast would: not worth a warning
# on the daemon's stderr. A filter, not a context manager around each conversion: that would cost
# the small-request hot path several microseconds.
warnings.filterwarnings("ignore", "overflow encountered in cast", RuntimeWarning, __name__)

# numpy's own limit on dimensions is 32 (numpy 1.x) or 64 (2.x); no model needs more than a few.
MAX_DIMS = 32
# Any shape whose element count (zero dimensions counted as one, so that [0, 2**70] is caught
# too) exceeds this cannot describe a tensor a request may carry, and would overflow numpy's
# index type.
MAX_ELEMENTS = 2**48


def v2_datatype(dtype: str) -> str:
    return NUMPY_TO_V2.get(dtype, dtype.upper())


def parse_shape(raw: Any, where: str) -> tuple[int, ...]:
    if (
        not isinstance(raw, list)
        or len(raw) > MAX_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in raw)
    ):
        raise BadRequestError(f"{where}: 'shape' must be a list of at most {MAX_DIMS} non-negative integers")
    if (math.prod(raw) if 0 not in raw else math.prod(d or 1 for d in raw)) > MAX_ELEMENTS:
        raise BadRequestError(f"{where}: shape {raw} holds more than {MAX_ELEMENTS} elements")
    return tuple(raw)


def parse_dtype(raw: Any, where: str) -> np.dtype[Any]:
    name = V2_TO_NUMPY.get(raw) if isinstance(raw, str) else None
    if name is None:
        raise BadRequestError(f"{where}: unsupported 'datatype' {raw!r}; one of {', '.join(V2_TO_NUMPY)}")
    return np.dtype(name)


def _check_layout(data: Any, shape: tuple[int, ...], where: str) -> None:
    """'data' is either flat (one list of every element, row-major) or nested exactly as the
    shape. Checked list by list, never element by element: the leaves are numpy's job."""
    count = math.prod(shape)
    if not isinstance(data, list):
        if count == 1:
            return  # a scalar for a one-element tensor, as tritonclient sends for shape []
        raise BadRequestError(f"{where}: 'data' must be a list")
    if not data or not isinstance(data[0], list):
        if len(data) != count:
            raise BadRequestError(f"{where}: shape {list(shape)} needs {count} values, 'data' has {len(data)}")
        return
    level: list[Any] = [data]
    for depth, dim in enumerate(shape):
        nxt: list[Any] = []
        for node in level:
            if not isinstance(node, list) or len(node) != dim:
                raise BadRequestError(f"{where}: 'data' is not laid out as shape {list(shape)} (axis {depth})")
            if depth + 1 < len(shape):
                nxt.extend(node)
        level = nxt


def from_json_data(data: Any, dtype: np.dtype[Any], shape: tuple[int, ...], where: str) -> np.ndarray:
    _check_layout(data, shape, where)
    try:
        arr = np.asarray(data, dtype=dtype)
    except (ValueError, TypeError, OverflowError) as e:
        raise BadRequestError(f"{where}: 'data' does not hold {v2_datatype(dtype.name)} values: {e}") from None
    count = math.prod(shape)
    if arr.size != count or arr.ndim not in (0, 1, len(shape)):
        raise BadRequestError(f"{where}: shape {list(shape)} needs {count} values, 'data' has {arr.size}")
    return arr.reshape(shape)


def from_bytes(buf: memoryview | bytes, dtype: np.dtype[Any], shape: tuple[int, ...], where: str) -> np.ndarray:
    need = math.prod(shape) * dtype.itemsize
    if len(buf) != need:
        raise BadRequestError(
            f"{where}: shape {list(shape)} of {v2_datatype(dtype.name)} needs {need} bytes, got {len(buf)}"
        )
    return np.frombuffer(buf, dtype=dtype).reshape(shape)
