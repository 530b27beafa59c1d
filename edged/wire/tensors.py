"""The request's tensor types, and tensors from untrusted request fields: shapes, datatypes,
JSON data and raw bytes. The wire rules of a tensor live here (edged/wire/validate.py holds the rules
of a model's inputs): both transports' decoders and the client use these functions.

Every check here runs before numpy allocates anything, and each costs time linear in what the
client actually sent (a request body is bounded by ``max_body``): a shape's element count is
bounded, JSON data must be laid out as the shape says before it is converted, and raw bytes
must match the shape exactly.

BYTES tensors (ONNX ``tensor(string)``) are numpy object arrays of ``bytes`` inside edged. On the
wire they are what Triton's binary tensor data extension says: each element a 4-byte
little-endian length, then its bytes; in JSON each element is a string (its UTF-8 bytes).
"""

from __future__ import annotations

import math
import struct
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
    "BYTES": "object",
}
NUMPY_TO_V2 = {v: k for k, v in V2_TO_NUMPY.items()}

# (region name, offset, byte size) -> a writable view of exactly that many bytes.
ShmResolver = Callable[[str, int, int], memoryview]
# The same for an output, or None: its bytes are there already (written by the model's worker
# thread right after the run, worker_writes.EarlyWrites).
OutputResolver = Callable[[str, int, int], "memoryview | None"]


@dataclass
class OutputRequest:
    name: str
    binary: bool = False
    shm_region: str | None = None
    shm_offset: int = 0
    shm_size: int = 0

    def copy(self) -> OutputRequest:
        """A request's own copy of a planned output (a plan is shared by every request with the
        same header); four times faster than dataclasses.replace."""
        return OutputRequest(self.name, self.binary, self.shm_region, self.shm_offset, self.shm_size)


@dataclass(init=False)
class InferRequest:
    id: str
    inputs: dict[str, np.ndarray]
    outputs: list[OutputRequest] | None  # None: every output, as JSON unless binary_all
    binary_all: bool
    parameters: dict[str, Any]
    # BYTES inputs in shared memory: (name, the daemon's buffer, shape), read once it is filled.
    pending: list[tuple[str, memoryview, tuple[int, ...]]]
    # What fixed every input's name, datatype and shape (the decoder's plan of a header whose
    # tensors are all laid out in the binary part), so that a check of them can be remembered
    # by it; None where they were read from the request itself. Not part of a request's value.
    shapes: object = field(default=None, compare=False, repr=False)

    def __init__(
        self,
        id: str = "",
        inputs: dict[str, np.ndarray] | None = None,
        outputs: list[OutputRequest] | None = None,
        binary_all: bool = False,
        parameters: dict[str, Any] | None = None,
    ) -> None:
        # Written out: one per request, and dataclass's own (default factories) ran three times
        # as many lines.
        self.id, self.inputs, self.outputs, self.binary_all = id, {} if inputs is None else inputs, outputs, binary_all
        self.parameters, self.pending, self.shapes = {} if parameters is None else parameters, [], None


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


_PREFIX = struct.Struct("<I")
# wire_nbytes counts the lengths of at most this many BYTES elements (a short pass, on the loop).
_COUNTED_ELEMENTS = 4096


def v2_datatype(dtype: str) -> str:
    if dtype.startswith(("bytes", "str")):  # numpy's fixed-width S and U arrays: strings too
        return "BYTES"
    return NUMPY_TO_V2.get(dtype, dtype.upper())


_DATATYPES: dict[np.dtype[Any], str] = {}
_DATATYPES_MAX = 64  # the dtypes of a config's models' outputs: a handful


def datatype_of(dtype: np.dtype[Any]) -> str:
    """``v2_datatype(dtype.name)``, remembered per dtype: numpy's ``dtype.name`` is computed in
    Python on each read (3% of the event loop's time at c=1 for the tiny model)."""
    found = _DATATYPES.get(dtype)
    if found is None:
        found = v2_datatype(dtype.name)
        if len(_DATATYPES) < _DATATYPES_MAX:
            _DATATYPES[dtype] = found
    return found


def is_bytes(dtype: np.dtype[Any]) -> bool:
    """A BYTES tensor: variable-length elements, never a fixed itemsize."""
    return dtype.kind in "OSU"


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
            raise BadRequestError(f"{where}: shape {list(shape)} needs {count} values, {len(data)} were given")
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
    if is_bytes(dtype):
        return _bytes_from_json(data, shape, where)
    try:
        arr = np.asarray(data, dtype=dtype)
    except (ValueError, TypeError, OverflowError) as e:
        raise BadRequestError(f"{where}: 'data' does not hold {v2_datatype(dtype.name)} values: {e}") from None
    count = math.prod(shape)
    if arr.size != count or arr.ndim not in (0, 1, len(shape)):
        raise BadRequestError(f"{where}: shape {list(shape)} needs {count} values, {arr.size} were given")
    return arr.reshape(shape)


def _bytes_from_json(data: Any, shape: tuple[int, ...], where: str) -> np.ndarray:
    """JSON strings, each element's UTF-8 bytes (the layout is checked already)."""
    nested = np.asarray(data if isinstance(data, list) else [data], dtype=object)
    flat = nested.reshape(-1)
    count = math.prod(shape)
    if flat.size != count:
        raise BadRequestError(f"{where}: shape {list(shape)} needs {count} values, {flat.size} were given")
    if nested.ndim not in (1, len(shape)):  # lists below the shape's last axis: not its layout
        raise BadRequestError(f"{where}: 'data' is nested deeper than shape {list(shape)}")
    out = np.empty(count, dtype=object)
    for i, value in enumerate(flat):
        if not isinstance(value, str):
            raise BadRequestError(f"{where}: BYTES 'data' must hold strings, element {i} is {type(value).__name__}")
        try:
            out[i] = value.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate escape such as "\\ud800"
            raise BadRequestError(f"{where}: BYTES element {i} is not valid Unicode text") from None
    return out.reshape(shape)


def from_bytes(buf: memoryview | bytes, dtype: np.dtype[Any], shape: tuple[int, ...], where: str) -> np.ndarray:
    if is_bytes(dtype):
        return deserialize_bytes(buf, shape, where)
    need = math.prod(shape) * dtype.itemsize
    if len(buf) != need:
        raise BadRequestError(
            f"{where}: shape {list(shape)} of {v2_datatype(dtype.name)} needs {need} bytes, got {len(buf)}"
        )
    # frombuffer holds ``buf`` (a view of a client's mapped memfd, maybe) while the array lives:
    # that hold is what keeps the region from being unmapped under a running model (memfd.unmap).
    # np.ndarray(buffer=...) would be one call less, but drops it.
    return np.frombuffer(buf, dtype=dtype).reshape(shape)


def deserialize_bytes(buf: memoryview | bytes, shape: tuple[int, ...], where: str) -> np.ndarray:
    """Length-prefixed elements, exactly ``prod(shape)`` of them filling ``buf``: one pass, each
    element copied once (so the array owns its bytes, whatever ``buf`` was a view of)."""
    count, end = math.prod(shape), len(buf) if isinstance(buf, bytes) else memoryview(buf).nbytes
    if count * _PREFIX.size > end:  # before allocating: every element needs its prefix
        raise BadRequestError(
            f"{where}: shape {list(shape)} of BYTES needs at least {count * _PREFIX.size} bytes "
            f"(a 4-byte length per element), got {end}"
        )
    # Each element copied once, straight from the request's buffer: a copy of the whole buffer
    # first (to slice bytes from it) held the body twice over for a moment, and for a BYTES tensor
    # of hundreds of MiB that moment is the request's peak.
    data = buf if isinstance(buf, bytes) else memoryview(buf).cast("B")
    unpack, step = _PREFIX.unpack_from, _PREFIX.size
    elements: list[bytes] = []
    pos = 0
    for i in range(count):
        if pos + step > end:
            raise BadRequestError(f"{where}: BYTES element {i} has no room for its 4-byte length (byte {pos} of {end})")
        (size,) = unpack(data, pos)
        pos += step
        if size > end - pos:
            raise BadRequestError(
                f"{where}: BYTES element {i}'s length prefix ({size} bytes, at byte {pos - step}) "
                f"runs past the end of its data ({end} bytes)"
            )
        elements.append(bytes(data[pos : pos + size]))
        pos += size
    out = np.empty(count, dtype=object)
    out[:] = elements
    if pos != end:
        raise BadRequestError(f"{where}: {end - pos} bytes follow the last of its {count} BYTES elements")
    return out.reshape(shape)


def _element(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, np.bytes_):
        return bytes(value)
    raise TypeError(f"a BYTES element must be bytes or str, not {type(value).__name__}")


def serialize_bytes(arr: np.ndarray) -> bytes:
    """Row-major, each element as a 4-byte little-endian length and its bytes."""
    pack = _PREFIX.pack
    parts: list[bytes] = []
    for value in arr.reshape(-1).tolist():
        raw = value if type(value) is bytes else _element(value)
        parts += (pack(len(raw)), raw)
    return b"".join(parts)


def wire_nbytes(arr: np.ndarray) -> int:
    """About how many bytes a tensor takes on the wire (what decides whether its encoding leaves
    the event loop): ``nbytes``, but for BYTES its elements' lengths (an object array's nbytes
    counts only pointers)."""
    if arr.dtype.kind != "O":
        return int(arr.nbytes)
    if arr.size > _COUNTED_ELEMENTS:  # so many that a worker thread pays whatever their lengths
        return 64 * arr.size
    return 4 * arr.size + sum(len(v) if isinstance(v, (bytes, str)) else 8 for v in arr.reshape(-1).tolist())


def tensor_bytes(arr: np.ndarray) -> bytes | memoryview:
    """A tensor as the binary tensor data extension carries it (a view when no copy is needed)."""
    if is_bytes(arr.dtype):
        return serialize_bytes(arr)
    return np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data


def tensor_bytes_copy(arr: np.ndarray) -> bytes:
    """``tensor_bytes`` as bytes of its own, for a small answer joined into one body: ``tobytes``
    is one numpy call where the view takes four and a copy (0.1 against 1.4 us on the 2-core machine)."""
    return serialize_bytes(arr) if is_bytes(arr.dtype) else arr.tobytes()


def json_strings(flat: np.ndarray, where: str) -> list[str]:
    """A BYTES tensor's elements as JSON strings: their UTF-8 text."""
    out: list[str] = []
    for i, value in enumerate(flat.tolist()):
        if isinstance(value, str):
            out.append(value)
            continue
        try:
            out.append(_element(value).decode("utf-8"))
        except UnicodeDecodeError:
            raise BadRequestError(
                f"{where}: BYTES element {i} is not UTF-8 text, which JSON cannot carry; ask for it as binary data"
            ) from None
    return out
