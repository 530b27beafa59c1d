"""The Open Inference Protocol (KServe v2) infer body: JSON tensors, the binary tensor data
extension, and the system shared memory extension's tensor parameters.

Both transports decode with this module (MQTT carries the same JSON as the HTTP body), so the
same input is parsed the same way everywhere. It checks that a request is well formed and
self-consistent; whether its tensors fit the model is the service's job.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from edged.errors import BadRequestError

V2_TO_NUMPY = {
    "BOOL": "bool", "UINT8": "uint8", "UINT16": "uint16", "UINT32": "uint32", "UINT64": "uint64",
    "INT8": "int8", "INT16": "int16", "INT32": "int32", "INT64": "int64",
    "FP16": "float16", "FP32": "float32", "FP64": "float64",
}
NUMPY_TO_V2 = {v: k for k, v in V2_TO_NUMPY.items()}

# (region name, offset, byte size) -> a writable view of exactly that many bytes.
ShmResolver = Callable[[str, int, int], memoryview]

_JSON_OPTS = orjson.OPT_SERIALIZE_NUMPY


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


def v2_datatype(dtype: str) -> str:
    return NUMPY_TO_V2.get(dtype, dtype.upper())


def _obj(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadRequestError(f"{what} must be a JSON object")
    return value


def _shape(raw: Any, where: str) -> tuple[int, ...]:
    if not isinstance(raw, list) or not all(isinstance(d, int) and d >= 0 for d in raw):
        raise BadRequestError(f"{where}: 'shape' must be a list of non-negative integers")
    return tuple(raw)


def _dtype(raw: Any, where: str) -> np.dtype[Any]:
    name = V2_TO_NUMPY.get(raw) if isinstance(raw, str) else None
    if name is None:
        raise BadRequestError(
            f"{where}: unsupported 'datatype' {raw!r}; one of {', '.join(V2_TO_NUMPY)}"
        )
    return np.dtype(name)


def _from_json_data(data: Any, dtype: np.dtype[Any], shape: tuple[int, ...], where: str) -> np.ndarray:
    try:
        arr = np.asarray(data, dtype=dtype)
    except (ValueError, TypeError, OverflowError) as e:
        raise BadRequestError(f"{where}: 'data' does not hold {dtype} values: {e}") from None
    count = math.prod(shape)
    if arr.size != count:
        raise BadRequestError(
            f"{where}: shape {list(shape)} needs {count} values, 'data' has {arr.size}"
        )
    return arr.reshape(shape)


def _from_bytes(buf: memoryview | bytes, dtype: np.dtype[Any], shape: tuple[int, ...], where: str) -> np.ndarray:
    need = math.prod(shape) * dtype.itemsize
    if len(buf) != need:
        raise BadRequestError(
            f"{where}: shape {list(shape)} of {v2_datatype(dtype.name)} needs {need} bytes, got {len(buf)}"
        )
    return np.frombuffer(buf, dtype=dtype).reshape(shape)


def _int_param(params: Mapping[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = params.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadRequestError(f"{where}: parameter '{key}' must be a non-negative integer")
    return value


def _decode_input(
    raw: Any, binary: memoryview, offset: int, shm: ShmResolver | None, idx: int
) -> tuple[str, np.ndarray, int]:
    inp = _obj(raw, f"inputs[{idx}]")
    name = inp.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequestError(f"inputs[{idx}]: 'name' must be a non-empty string")
    where = f"input '{name}'"
    shape = _shape(inp.get("shape"), where)
    dtype = _dtype(inp.get("datatype"), where)
    params = _obj(inp.get("parameters") or {}, f"{where}: 'parameters'")
    if "shared_memory_region" in params:
        if shm is None:
            raise BadRequestError(f"{where}: shared memory is not available on this transport")
        region = params["shared_memory_region"]
        if not isinstance(region, str):
            raise BadRequestError(f"{where}: 'shared_memory_region' must be a string")
        size = _int_param(params, "shared_memory_byte_size", where)
        view = shm(region, _int_param(params, "shared_memory_offset", where, 0), size)
        return name, _from_bytes(view, dtype, shape, where), offset
    if "binary_data_size" in params:
        size = _int_param(params, "binary_data_size", where)
        if offset + size > len(binary):
            raise BadRequestError(
                f"{where}: 'binary_data_size' {size} runs past the end of the binary data"
            )
        return name, _from_bytes(binary[offset:offset + size], dtype, shape, where), offset + size
    if "data" not in inp:
        raise BadRequestError(f"{where}: needs 'data', binary data or a shared memory region")
    return name, _from_json_data(inp["data"], dtype, shape, where), offset


def _decode_output(raw: Any, binary_all: bool, idx: int) -> OutputRequest:
    out = _obj(raw, f"outputs[{idx}]")
    name = out.get("name")
    if not isinstance(name, str):
        raise BadRequestError(f"outputs[{idx}]: 'name' must be a string")
    params = _obj(out.get("parameters") or {}, f"output '{name}': 'parameters'")
    req = OutputRequest(name, bool(params.get("binary_data", binary_all)))
    if "shared_memory_region" in params:
        region = params["shared_memory_region"]
        if not isinstance(region, str):
            raise BadRequestError(f"output '{name}': 'shared_memory_region' must be a string")
        req.shm_region = region
        req.shm_size = _int_param(params, "shared_memory_byte_size", f"output '{name}'")
        req.shm_offset = _int_param(params, "shared_memory_offset", f"output '{name}'", 0)
    return req


def decode_infer(
    body: bytes | memoryview, header_length: int | None = None, shm: ShmResolver | None = None
) -> InferRequest:
    """Parse an infer body: JSON alone, or (binary extension) JSON of ``header_length`` bytes
    followed by the tensors' raw bytes in the order of the inputs that declare them."""
    view = memoryview(body)
    if header_length is None:
        header_length = len(view)
    elif header_length > len(view):
        raise BadRequestError(
            f"Inference-Header-Content-Length {header_length} exceeds the body ({len(view)} bytes)"
        )
    try:
        doc = orjson.loads(view[:header_length])
    except orjson.JSONDecodeError as e:
        raise BadRequestError(f"malformed JSON: {e}") from None
    doc = _obj(doc, "request body")
    inputs_raw = doc.get("inputs")
    if not isinstance(inputs_raw, list) or not inputs_raw:
        raise BadRequestError("'inputs' must be a non-empty list")
    params = _obj(doc.get("parameters") or {}, "'parameters'")
    binary_all = bool(params.get("binary_data_output", False))
    binary = view[header_length:]
    req = InferRequest(id=str(doc.get("id", "")), binary_all=binary_all, parameters=params)
    offset = 0
    for idx, raw in enumerate(inputs_raw):
        name, arr, offset = _decode_input(raw, binary, offset, shm, idx)
        if name in req.inputs:
            raise BadRequestError(f"input '{name}' is given twice")
        req.inputs[name] = arr
    if offset != len(binary):
        raise BadRequestError(f"{len(binary) - offset} bytes of binary data belong to no input")
    outputs_raw = doc.get("outputs")
    if outputs_raw is not None:
        if not isinstance(outputs_raw, list):
            raise BadRequestError("'outputs' must be a list")
        req.outputs = [_decode_output(o, binary_all, i) for i, o in enumerate(outputs_raw)]
    return req


def encode_infer(
    model: str, req: InferRequest, results: Mapping[str, np.ndarray],
    shm: ShmResolver | None = None,
) -> tuple[bytes, int | None]:
    """(body, header length or None when the body is plain JSON)."""
    wanted = req.outputs
    if wanted is None:
        wanted = [OutputRequest(n, req.binary_all) for n in results]
    entries: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for out in wanted:
        arr = results.get(out.name)
        if arr is None:
            raise BadRequestError(f"requested output '{out.name}' is not an output of '{model}'")
        entry: dict[str, Any] = {
            "name": out.name, "datatype": v2_datatype(arr.dtype.name), "shape": list(arr.shape),
        }
        if out.shm_region is not None and shm is not None:
            data = np.ascontiguousarray(arr)
            if data.nbytes > out.shm_size:
                raise BadRequestError(
                    f"output '{out.name}' needs {data.nbytes} bytes, region "
                    f"'{out.shm_region}' was given {out.shm_size}"
                )
            dest = np.frombuffer(shm(out.shm_region, out.shm_offset, data.nbytes), dtype=np.uint8)
            dest[:] = data.reshape(-1).view(np.uint8)
            entry["parameters"] = {
                "shared_memory_region": out.shm_region, "shared_memory_byte_size": data.nbytes,
            }
        elif out.binary:
            raw = np.ascontiguousarray(arr).tobytes()
            chunks.append(raw)
            entry["parameters"] = {"binary_data_size": len(raw)}
        else:
            flat = arr.reshape(-1)
            entry["data"] = flat.astype(np.float32) if flat.dtype == np.float16 else flat
        entries.append(entry)
    doc: dict[str, Any] = {"model_name": model, "model_version": "1", "outputs": entries}
    if req.id:
        doc["id"] = req.id
    header = orjson.dumps(doc, option=_JSON_OPTS)
    if not chunks:
        return header, None
    return b"".join([header, *chunks]), len(header)
