"""Whether a request's tensors fit a model: names, datatypes, shapes and their bounds.

The one owner of these rules. The wire rules of a single tensor (datatype names,
shape limits, byte sizes, BYTES framing) are edged/wire/tensors.py's; this module checks decoded
arrays against what a model takes. A backend builds its ``InputRules`` once at load (adding what
is truly its own, such as a TensorRT engine's profile bounds); the service narrows them with the
model's config (profiles, max_batch) once per load and runs ``check`` once per request, on the
hot path; the scheduler then tells the backend the inputs are checked, so no tensor is checked
twice. Direct callers of a backend (warm-up, the accuracy gate, the self-test) get the same
check from ``Backend.check_inputs``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from edged.errors import BadRequestError, InvalidInputError, PayloadTooLargeError
from edged.wire.tensors import v2_datatype

Bounds = tuple[tuple[int, ...], tuple[int, ...]]  # (smallest, largest) shape accepted


class Spec(Protocol):
    """What a backend reports of one input (edged.backends.base.TensorSpec)."""

    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class InputRule:
    name: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]  # -1: a dynamic dimension
    bounds: Bounds | None = None
    # The fast test of a shape, set once here (frozen): the shape itself when it is fully static,
    # the dims after the first when only the first (the batch) is dynamic, else None.
    _static: tuple[int, ...] | None = field(init=False, repr=False, compare=False, default=None)
    _tail: tuple[int, ...] | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        shape = self.shape
        if self.bounds is None and all(d >= 0 for d in shape):
            object.__setattr__(self, "_static", shape)
        elif self.bounds is None and shape and shape[0] < 0 and all(d >= 0 for d in shape[1:]):
            object.__setattr__(self, "_tail", shape[1:])

    def fits(self, got: tuple[int, ...]) -> bool:
        """``shape_error(got) == ''``, without building anything for the common shapes."""
        if self._static is not None:
            return got == self._static
        if self._tail is not None:
            return len(got) == len(self.shape) and got[1:] == self._tail
        return not self.shape_error(got)

    def shape_error(self, got: tuple[int, ...]) -> str:
        """Why ``got`` does not fit, or '' when it does."""
        if len(got) != len(self.shape) or any(w >= 0 and w != g for w, g in zip(self.shape, got)):
            return f"expected shape {dims(self.shape)}, got {list(got)}"
        if self.bounds is not None:
            lo, hi = self.bounds
            for i, (g, a, b) in enumerate(zip(got, lo, hi)):
                if not a <= g <= b:
                    where = f"dim {i} is {g}, not {a}..{b}"
                    return f"shape {list(got)} is outside the profile {list(lo)}..{list(hi)} ({where})"
        return ""


@dataclass(frozen=True)
class InputRules:
    """A model's inputs as a request must give them: built once per load, checked per request."""

    rules: tuple[InputRule, ...]
    model: str = ""
    max_batch: int = 1  # > 1: the first dimension may not exceed it
    names: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", frozenset(r.name for r in self.rules))  # frozen: set once here

    def check(self, inputs: Mapping[str, np.ndarray]) -> None:
        """Names, datatypes and shapes, with an error that says what was expected."""
        if len(inputs) != len(self.rules) or not self.names.issuperset(inputs):
            want = ", ".join(r.name for r in self.rules)
            whose = f"model '{self.model}' takes" if self.model else "expected"
            raise InvalidInputError(f"{whose} inputs [{want}], got [{', '.join(inputs)}]")
        for rule in self.rules:
            arr = inputs[rule.name]
            dtype, shape = arr.dtype, arr.shape
            if dtype is not rule.dtype and dtype != rule.dtype:  # numpy's dtypes are mostly singletons
                raise InvalidInputError(
                    f"input '{rule.name}': expected datatype {v2_datatype(rule.dtype.name)}, "
                    f"got {v2_datatype(dtype.name)}"
                )
            if not rule.fits(shape):
                raise InvalidInputError(f"input '{rule.name}': {rule.shape_error(shape)}")
            if self.max_batch > 1 and shape and shape[0] > self.max_batch:
                raise InvalidInputError(f"input '{rule.name}': batch {shape[0]} > max_batch {self.max_batch}")

    def narrowed(self, model: str, bounds: Mapping[str, Bounds], max_batch: int) -> InputRules:
        """These rules for one configured model: its profiles intersected with the backend's
        own bounds (the stricter of the two wins), its max_batch."""
        rules = []
        for r in self.rules:
            extra = bounds.get(r.name)
            if extra is not None and len(extra[0]) == len(r.shape):
                rules.append(replace(r, bounds=_intersect(r.bounds, extra)))
            else:
                rules.append(r)
        return InputRules(tuple(rules), model, max_batch)


def rules_of(specs: Iterable[Spec], bounds: Mapping[str, Bounds] | None = None) -> InputRules:
    """A backend's inputs as rules; ``bounds``: shapes the backend itself cannot go beyond."""
    bounds = bounds or {}
    return InputRules(tuple(InputRule(s.name, np.dtype(s.dtype), tuple(s.shape), bounds.get(s.name)) for s in specs))


def _intersect(a: Bounds | None, b: Bounds) -> Bounds:
    if a is None:
        return b
    return tuple(map(max, a[0], b[0])), tuple(map(min, a[1], b[1]))


def dims(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join("-1" if d < 0 else str(d) for d in shape) + "]"


# --- what a request may hold, before its tensors are decoded ------------------------------------

# How many tensors one request may name when the model's own count is not known (a model that
# is not loaded yet). Past it a request is refused before its list is walked.
MAX_TENSORS = 1024

# The JSON part's default bound (server.max_json).
MAX_JSON = 8 << 20
# JSON objects a request may hold besides two per named tensor (the tensor and its parameters):
# the body, its parameters, and room for clients that send empty objects.
_SPARE_OBJECTS = 16
# A JSON part this short parses in well under a millisecond whatever it holds: not scanned.
_SMALL_JSON = 4096
# Counting braces scans the body in slices of this size, so that on a worker thread no single
# call holds the interpreter lock for long.
_SCAN_SLICE = 1 << 20


@dataclass(frozen=True)
class Limits:
    """How many inputs and outputs a request may name: the model's own counts when known."""

    inputs: int = MAX_TENSORS
    outputs: int = MAX_TENSORS
    model: str = ""
    json_bytes: int = MAX_JSON
    # The model's BYTES inputs (None: not known yet). A BYTES tensor costs a Python object per
    # element to read, so one the model does not take is refused before it is read: 32 MiB of
    # two-byte elements sent to a float model took 1.8 s and 375 MiB before its dtype was checked.
    bytes_inputs: frozenset[str] | None = None


DEFAULT_LIMITS = Limits()


def check_counts(n_inputs: int, n_outputs: int, limits: Limits) -> None:
    """Refused before the lists are walked: a request names no more tensors than the model has."""
    if n_inputs <= limits.inputs and n_outputs <= limits.outputs:
        return
    whose = f"model '{limits.model}' has" if limits.model else "a request may name at most"
    if n_inputs > limits.inputs:
        raise InvalidInputError(f"the request lists {n_inputs} inputs; {whose} {limits.inputs}")
    raise InvalidInputError(f"the request asks for {n_outputs} outputs; {whose} {limits.outputs}")


def check_bytes_inputs(names: Iterable[tuple[str, bool]], limits: Limits) -> None:
    """(name, is BYTES) of each input a request declares: a BYTES one the model does not take is
    refused before its elements are read."""
    allowed = limits.bytes_inputs
    if allowed is None:
        return
    for name, is_bytes in names:
        if is_bytes and name not in allowed:
            whose = f"model '{limits.model}'" if limits.model else "the model"
            raise InvalidInputError(f"input '{name}': {whose} takes no BYTES input of that name")


def check_json_size(body: bytes | memoryview, end: int, limits: Limits) -> None:
    """Before parsing: the JSON part is within server.max_json, and holds no more objects than a
    request for this model can (every object needs a '{', so counting them bounds the objects;
    a body of 480,000 tiny objects cost 3.2 s of parsing and collecting)."""
    if end > limits.json_bytes:
        raise PayloadTooLargeError(
            f"the JSON part of the request is {end} bytes, over the limit of {limits.json_bytes} (server.max_json); "
            "send large tensors with the binary tensor extension or shared memory"
        )
    allowed = 2 * (limits.inputs + limits.outputs) + _SPARE_OBJECTS
    if end <= max(allowed, _SMALL_JSON):
        return  # too short to hold more objects than allowed, or too short to matter
    raw = body if isinstance(body, bytes) else bytes(memoryview(body)[:end])
    found = 0
    for start in range(0, end, _SCAN_SLICE):
        found += raw.count(b"{", start, min(end, start + _SCAN_SLICE))
        if found > allowed:
            whose = f"for model '{limits.model}'" if limits.model else ""
            raise InvalidInputError(f"the request holds more JSON objects than a request {whose} can ({allowed})")


def check_json_part(body: bytes | memoryview, header_length: int | None, limits: Limits) -> int:
    """The JSON part's length, once it is known to be within bounds (see check_json_size)."""
    end = len(body) if header_length is None else header_length
    if end > len(body):
        raise BadRequestError(f"Inference-Header-Content-Length {end} exceeds the body ({len(body)} bytes)")
    check_json_size(body, end, limits)
    return end
