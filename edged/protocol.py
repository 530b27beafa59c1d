"""The Open Inference Protocol (KServe v2) infer body: JSON tensors, the binary tensor data
extension, and the system shared memory extension's tensor parameters.

Both transports decode with this module (MQTT carries the same JSON as the HTTP body), so the
same input is parsed the same way everywhere. It checks that a request is well formed and
self-consistent; whether its tensors fit the model is the service's job.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

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
        raise BadRequestError(f"{where}: unsupported 'datatype' {raw!r}; one of {', '.join(V2_TO_NUMPY)}")
    return np.dtype(name)


def _from_json_data(data: Any, dtype: np.dtype[Any], shape: tuple[int, ...], where: str) -> np.ndarray:
    try:
        arr = np.asarray(data, dtype=dtype)
    except (ValueError, TypeError, OverflowError) as e:
        raise BadRequestError(f"{where}: 'data' does not hold {dtype} values: {e}") from None
    count = math.prod(shape)
    if arr.size != count:
        raise BadRequestError(f"{where}: shape {list(shape)} needs {count} values, 'data' has {arr.size}")
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


@dataclass(frozen=True)
class _InputPlan:
    """One input as its header describes it; the tensor bytes are found per request."""

    name: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    kind: str  # "json" | "binary" | "shm"
    size: int = 0
    region: str = ""
    offset: int = 0
    data: Any = None


def _plan_input(raw: Any, idx: int) -> _InputPlan:
    inp = _obj(raw, f"inputs[{idx}]")
    name = inp.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequestError(f"inputs[{idx}]: 'name' must be a non-empty string")
    where = f"input '{name}'"
    shape = _shape(inp.get("shape"), where)
    dtype = _dtype(inp.get("datatype"), where)
    params = _obj(inp.get("parameters") or {}, f"{where}: 'parameters'")
    if "shared_memory_region" in params:
        region = params["shared_memory_region"]
        if not isinstance(region, str):
            raise BadRequestError(f"{where}: 'shared_memory_region' must be a string")
        return _InputPlan(
            name,
            dtype,
            shape,
            "shm",
            _int_param(params, "shared_memory_byte_size", where),
            region,
            _int_param(params, "shared_memory_offset", where, 0),
        )
    if "binary_data_size" in params:
        return _InputPlan(name, dtype, shape, "binary", _int_param(params, "binary_data_size", where))
    if "data" not in inp:
        raise BadRequestError(f"{where}: needs 'data', binary data or a shared memory region")
    return _InputPlan(name, dtype, shape, "json", data=inp["data"])


def _materialize(p: _InputPlan, binary: memoryview, offset: int, shm: ShmResolver | None) -> tuple[np.ndarray, int]:
    where = f"input '{p.name}'"
    if p.kind == "shm":
        if shm is None:
            raise BadRequestError(f"{where}: shared memory is not available on this transport")
        return _from_bytes(shm(p.region, p.offset, p.size), p.dtype, p.shape, where), offset
    if p.kind == "binary":
        if offset + p.size > len(binary):
            raise BadRequestError(f"{where}: 'binary_data_size' {p.size} runs past the end of the binary data")
        return _from_bytes(binary[offset : offset + p.size], p.dtype, p.shape, where), offset + p.size
    return _from_json_data(p.data, p.dtype, p.shape, where), offset


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


@dataclass(frozen=True)
class _RequestPlan:
    id: str
    binary_all: bool
    parameters: dict[str, Any]
    inputs: tuple[_InputPlan, ...]
    outputs: tuple[OutputRequest, ...] | None


# Clients send the same header for every frame of a stream (only the bytes after it change), so
# a header without inline JSON data is parsed once and its plan reused.
_PLANS: dict[bytes, _RequestPlan] = {}
_PLAN_CACHE_SIZE = 256


def _plan(header: memoryview) -> _RequestPlan:
    try:
        doc = orjson.loads(header)
    except orjson.JSONDecodeError as e:
        raise BadRequestError(f"malformed JSON: {e}") from None
    doc = _obj(doc, "request body")
    inputs_raw = doc.get("inputs")
    if not isinstance(inputs_raw, list) or not inputs_raw:
        raise BadRequestError("'inputs' must be a non-empty list")
    params = _obj(doc.get("parameters") or {}, "'parameters'")
    binary_all = bool(params.get("binary_data_output", False))
    inputs = tuple(_plan_input(raw, idx) for idx, raw in enumerate(inputs_raw))
    names = [p.name for p in inputs]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise BadRequestError(f"input '{dup}' is given twice")
    outputs_raw = doc.get("outputs")
    outputs = None
    if outputs_raw is not None:
        if not isinstance(outputs_raw, list):
            raise BadRequestError("'outputs' must be a list")
        outputs = tuple(_decode_output(o, binary_all, i) for i, o in enumerate(outputs_raw))
    return _RequestPlan(str(doc.get("id", "")), binary_all, params, inputs, outputs)


def _cached_plan(header: memoryview) -> _RequestPlan:
    key = header.tobytes()
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(header)
        if all(p.kind != "json" for p in plan.inputs):
            if len(_PLANS) >= _PLAN_CACHE_SIZE:
                _PLANS.clear()
            _PLANS[key] = plan
    return plan


def decode_infer(
    body: bytes | memoryview, header_length: int | None = None, shm: ShmResolver | None = None
) -> InferRequest:
    """Parse an infer body: JSON alone, or (binary extension) JSON of ``header_length`` bytes
    followed by the tensors' raw bytes in the order of the inputs that declare them."""
    view = memoryview(body)
    if header_length is None:
        header_length = len(view)
        plan = _plan(view)  # plain JSON carries its data inline: nothing to reuse
    elif header_length > len(view):
        raise BadRequestError(f"Inference-Header-Content-Length {header_length} exceeds the body ({len(view)} bytes)")
    else:
        plan = _cached_plan(view[:header_length])
    binary = view[header_length:]
    inputs: dict[str, np.ndarray] = {}
    offset = 0
    for p in plan.inputs:
        inputs[p.name], offset = _materialize(p, binary, offset, shm)
    if offset != len(binary):
        raise BadRequestError(f"{len(binary) - offset} bytes of binary data belong to no input")
    outputs = [dataclasses.replace(o) for o in plan.outputs] if plan.outputs is not None else None
    return InferRequest(plan.id, inputs, outputs, plan.binary_all, plan.parameters)


def encode_infer(
    model: str,
    req: InferRequest,
    results: Mapping[str, np.ndarray],
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
            "name": out.name,
            "datatype": v2_datatype(arr.dtype.name),
            "shape": list(arr.shape),
        }
        if out.shm_region is not None and shm is not None:
            data = np.ascontiguousarray(arr)
            if data.nbytes > out.shm_size:
                raise BadRequestError(
                    f"output '{out.name}' needs {data.nbytes} bytes, region '{out.shm_region}' was given {out.shm_size}"
                )
            dest = np.frombuffer(shm(out.shm_region, out.shm_offset, data.nbytes), dtype=np.uint8)
            dest[:] = data.reshape(-1).view(np.uint8)
            entry["parameters"] = {
                "shared_memory_region": out.shm_region,
                "shared_memory_byte_size": data.nbytes,
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
