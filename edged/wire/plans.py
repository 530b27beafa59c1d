"""An infer request's plan: what its JSON header says of every input and output, checked once.

A plan holds no tensor bytes: the same header (a stream of frames, a client's every request)
plans the same way, so ``PLANS`` remembers plans by their header's bytes and the decoder
(decode.py) reads each request's tensors with the plan it finds. ``check_within`` checks a
remembered plan against a model's limits once per model.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edged.errors import BadRequestError
from edged.wire.request_ids import request_id
from edged.wire.tensors import OutputRequest, is_bytes, parse_dtype, parse_shape
from edged.wire.validate import Limits, check_bytes_inputs, check_counts

# Headers at most this long are remembered with their plan; the cache holds at most _PLAN_BYTES
# of them (a stream's header is a few hundred bytes; a failed request's is never kept).
_PLAN_HEADER_MAX = 8192
_PLAN_BYTES = 1 << 20


def _obj(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadRequestError(f"{what} must be a JSON object")
    return value


def _int_param(params: Mapping[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = params.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadRequestError(f"{where}: parameter '{key}' must be a non-negative integer")
    return value


def _shm_params(params: Mapping[str, Any], where: str) -> tuple[str, int, int] | None:
    """(region, offset, byte size), or None when no region is named; the extension's rules:
    a region needs its byte size, and offset or byte size without a region is an error."""
    if "shared_memory_region" not in params:
        for key in ("shared_memory_byte_size", "shared_memory_offset") if params else ():
            if key in params:
                raise BadRequestError(f"{where}: '{key}' without 'shared_memory_region'")
        return None
    region = params["shared_memory_region"]
    if not isinstance(region, str) or not region:
        raise BadRequestError(f"{where}: 'shared_memory_region' must be a non-empty string")
    if "shared_memory_byte_size" not in params:
        raise BadRequestError(f"{where}: 'shared_memory_region' needs 'shared_memory_byte_size'")
    return (
        region,
        _int_param(params, "shared_memory_offset", where, 0),
        _int_param(params, "shared_memory_byte_size", where),
    )


@dataclass(frozen=True)
class InputPlan:
    """One input as its header describes it; the tensor bytes are found per request."""

    name: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    kind: str  # "json" | "binary" | "shm"
    size: int = 0
    region: str = ""
    offset: int = 0
    data: Any = None


def _plan_input(raw: Any, idx: int) -> InputPlan:
    inp = _obj(raw, f"inputs[{idx}]")
    name = inp.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequestError(f"inputs[{idx}]: 'name' must be a non-empty string")
    where = f"input '{name}'"
    shape = parse_shape(inp.get("shape"), where)
    dtype = parse_dtype(inp.get("datatype"), where)
    params = _obj(inp.get("parameters") or {}, f"{where}: 'parameters'")
    shm = _shm_params(params, where)
    if params and ("data" in inp) + (shm is not None) + ("binary_data_size" in params) > 1:
        raise BadRequestError(f"{where}: give one of 'data', 'binary_data_size' or 'shared_memory_region'")
    if shm is not None:
        return InputPlan(name, dtype, shape, "shm", shm[2], shm[0], shm[1])
    if "binary_data_size" in params:
        return InputPlan(name, dtype, shape, "binary", _int_param(params, "binary_data_size", where))
    if "data" not in inp:
        raise BadRequestError(f"{where}: needs 'data', binary data or a shared memory region")
    return InputPlan(name, dtype, shape, "json", data=inp["data"])


def _decode_output(raw: Any, binary_all: bool, idx: int) -> OutputRequest:
    out = _obj(raw, f"outputs[{idx}]")
    name = out.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequestError(f"outputs[{idx}]: 'name' must be a non-empty string")
    where = f"output '{name}'"
    params = _obj(out.get("parameters") or {}, f"{where}: 'parameters'")
    binary = params.get("binary_data", binary_all)
    if not isinstance(binary, bool):
        raise BadRequestError(f"{where}: 'binary_data' must be true or false")
    req = OutputRequest(name, binary)
    shm = _shm_params(params, where)
    if shm is not None:
        req.shm_region, req.shm_offset, req.shm_size = shm
    return req


# Compared and hashed by identity: a plan is one object shared by every request with its header
# (the model's plan remembers the ones whose inputs passed its check, service.ModelPlan.checked).
@dataclass(frozen=True, eq=False)
class RequestPlan:
    id: str
    binary_all: bool
    parameters: dict[str, Any]
    inputs: tuple[InputPlan, ...]
    outputs: tuple[OutputRequest, ...] | None
    # Where every input is a numeric tensor in the binary part whose declared size is its shape's
    # (a stream of frames, tiny's requests): (name, dtype, shape, start, end) of each in the
    # binary part, checked once here, so that a cached plan decodes without the per-input steps.
    layout: tuple[tuple[str, np.dtype[Any], tuple[int, ...], int, int], ...] | None = None
    # The last model's limits (validate.Limits, immutable) this plan was found within: a stream
    # of requests with one header is checked against its model's limits once, not per request.
    within: list[Limits | None] = field(default_factory=lambda: [None], compare=False, repr=False)


def _unique(names: Sequence[str], what: str) -> None:
    if len(names) < 2:
        return
    seen: set[str] = set()
    for n in names:
        if n in seen:
            raise BadRequestError(f"{what} '{n}' is given twice")
        seen.add(n)


def plan_document(doc: Any, limits: Limits) -> RequestPlan:
    """The request's plan from its parsed JSON: every field checked, nothing converted yet."""
    doc = _obj(doc, "request body")
    inputs_raw = doc.get("inputs")
    if not isinstance(inputs_raw, list) or not inputs_raw:
        raise BadRequestError("'inputs' must be a non-empty list")
    outputs_raw = doc.get("outputs")
    if outputs_raw is not None and not isinstance(outputs_raw, list):
        raise BadRequestError("'outputs' must be a list")
    check_counts(len(inputs_raw), len(outputs_raw or ()), limits)
    params = _obj(doc.get("parameters") or {}, "'parameters'")
    binary_all = params.get("binary_data_output", False)
    if not isinstance(binary_all, bool):
        raise BadRequestError("parameter 'binary_data_output' must be true or false")
    inputs = tuple(_plan_input(raw, idx) for idx, raw in enumerate(inputs_raw))
    check_bytes_inputs(((p.name, is_bytes(p.dtype)) for p in inputs), limits)
    _unique([p.name for p in inputs], "input")
    outputs = None
    if outputs_raw is not None:
        outputs = tuple(_decode_output(o, binary_all, i) for i, o in enumerate(outputs_raw))
        _unique([o.name for o in outputs], "output")
    return RequestPlan(request_id(doc.get("id", "")), binary_all, params, inputs, outputs, _layout(inputs))


def _layout(inputs: tuple[InputPlan, ...]) -> tuple[tuple[str, np.dtype[Any], tuple[int, ...], int, int], ...] | None:
    """``RequestPlan.layout`` for these inputs; None where any is not a binary numeric tensor of
    exactly its shape's size (those take the per-input path, which says what is wrong)."""
    layout = []
    start = 0
    for p in inputs:
        if p.kind != "binary" or is_bytes(p.dtype) or p.size != math.prod(p.shape) * p.dtype.itemsize:
            return None
        layout.append((p.name, p.dtype, p.shape, start, start + p.size))
        start += p.size
    return tuple(layout)


class PlanCache:
    """Plans of binary-extension headers, bounded by bytes (LRU). Clients send the same header
    for every frame of a stream (only the bytes after it change), so it is parsed once."""

    def __init__(self, max_bytes: int, max_header: int) -> None:
        self.max_bytes, self.max_header = max_bytes, max_header
        self.bytes = 0
        self._plans: OrderedDict[bytes, RequestPlan] = OrderedDict()
        self._lock = threading.Lock()  # large bodies are decoded on a worker thread

    def get(self, key: bytes) -> RequestPlan | None:
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
            return plan

    def put(self, key: bytes, plan: RequestPlan) -> None:
        if len(key) > self.max_header or any(p.kind == "json" and p.data is not None for p in plan.inputs):
            return  # a plan holding a request's values is that request's alone
        with self._lock:
            if key in self._plans:
                return
            self._plans[key] = plan
            self.bytes += len(key)
            while self.bytes > self.max_bytes:
                old, _ = self._plans.popitem(last=False)
                self.bytes -= len(old)

    def __len__(self) -> int:
        return len(self._plans)

    def distinct(self) -> int:
        """How many plans it holds: one may be cached under its header and its id's template."""
        with self._lock:
            return len({id(plan) for plan in self._plans.values()})

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()
            self.bytes = 0


PLANS = PlanCache(_PLAN_BYTES, _PLAN_HEADER_MAX)


def check_within(plan: RequestPlan, limits: Limits) -> None:
    """A remembered plan against this model's limits (once per model, as ``parse_body`` does)."""
    if plan.within[0] is not limits:
        check_counts(len(plan.inputs), len(plan.outputs or ()), limits)
        check_bytes_inputs(((p.name, is_bytes(p.dtype)) for p in plan.inputs), limits)
        plan.within[0] = limits
