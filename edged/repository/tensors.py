"""config.pbtxt's inputs and outputs against the model file's own tensors.

Triton's shapes leave out the batch dimension of a model with ``max_batch_size > 0``; edged's
include it, so the full shape is ``[-1] + dims`` there. A config may be narrower than its model
(a fixed size where the model takes any) but never wider, and ``reshape`` gives the shape the
model itself has where clients see ``dims``. A mismatch is refused, naming the tensor and both
sides. What a config fixes where its model is dynamic becomes edged's profile for that input,
which also bounds a TensorRT engine built from it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from edged.config import Reshape
from edged.errors import ConfigError
from edged.repository.signature import Signature, Tensor
from edged.wire.proto import model_config_pb2

# Triton's data types as numpy names ("object": strings, TYPE_STRING / BYTES).
DATA_TYPES = {
    "TYPE_BOOL": "bool",
    "TYPE_UINT8": "uint8",
    "TYPE_UINT16": "uint16",
    "TYPE_UINT32": "uint32",
    "TYPE_UINT64": "uint64",
    "TYPE_INT8": "int8",
    "TYPE_INT16": "int16",
    "TYPE_INT32": "int32",
    "TYPE_INT64": "int64",
    "TYPE_FP16": "float16",
    "TYPE_FP32": "float32",
    "TYPE_FP64": "float64",
    "TYPE_STRING": "object",
    "TYPE_BF16": "bfloat16",
}
_NAMES = {v: k for k, v in DATA_TYPES.items()}

ConfigTensor = model_config_pb2.ModelInput | model_config_pb2.ModelOutput


def type_name(data_type: int) -> str:
    return str(model_config_pb2.DataType.Name(data_type))  # type: ignore[arg-type]


def dtype_of(data_type: int, where: str) -> str:
    name = type_name(data_type)
    if name not in DATA_TYPES:
        raise ConfigError(f"{where}: data_type {name} is not a type a tensor can have")
    return DATA_TYPES[name]


@dataclass
class Checked:
    """What the tensors' check found for the translation."""

    input_reshape: dict[str, Reshape] = field(default_factory=dict)
    output_reshape: dict[str, Reshape] = field(default_factory=dict)
    formats: dict[str, str] = field(default_factory=dict)  # input → its format, for clients (DeepStream)
    # Input → [min, opt, max] where the config bounds a dimension the model leaves open.
    profiles: dict[str, list[list[int]]] = field(default_factory=dict)


def check(config: model_config_pb2.ModelConfig, sig: Signature, where: str, file: str, opt_batch: int = 1) -> Checked:
    """``config``'s tensors checked against ``sig`` (of ``file``, for messages)."""
    out = Checked()
    batch = config.max_batch_size
    if batch < 0:
        raise ConfigError(f"{where}: max_batch_size: {batch} is negative")
    if batch > 0:
        fixed = [t.name for t in (*sig.inputs, *sig.outputs) if not t.shape or t.shape[0] != -1]
        if fixed:
            raise ConfigError(
                f"{where}: max_batch_size: {batch} says the first dimension is a batch, but {file} fixes it for "
                f"'{fixed[0]}' ({_fmt(_shape_of(sig, fixed[0]))}); set max_batch_size: 0 and give full dims"
            )
    for kind, listed, actual in (("input", config.input, sig.inputs), ("output", config.output, sig.outputs)):
        _check_names(kind, listed, actual, where, file)
        model = {t.name: t for t in actual}
        for t in listed:
            _check_one(kind, t, model[t.name], batch, where, file, out, opt_batch)
    return out


def _shape_of(sig: Signature, name: str) -> tuple[int, ...]:
    return next(t.shape for t in (*sig.inputs, *sig.outputs) if t.name == name)


def _check_names(kind: str, listed: Sequence[ConfigTensor], actual: Sequence[Tensor], where: str, file: str) -> None:
    names = [t.name for t in listed]
    if not names:
        return  # none given: the model's own, as Triton completes them
    have = [t.name for t in actual]
    for i, name in enumerate(names):
        if not name:
            raise ConfigError(f"{where}: {kind}[{i}]: has no name")
        if name in names[:i]:
            raise ConfigError(f"{where}: {kind} '{name}': listed twice")
        if name not in have:
            raise ConfigError(f"{where}: {kind} '{name}': {file} has no such {kind} (its {kind}s: {', '.join(have)})")
    missing = [n for n in have if n not in names]
    if missing:
        raise ConfigError(
            f"{where}: {kind} '{missing[0]}' of {file} is not listed: list every {kind} of the model, or none"
        )


def _check_one(
    kind: str, t: ConfigTensor, model: Tensor, batch: int, where: str, file: str, out: Checked, opt_batch: int
) -> None:
    label = f"{where}: {kind} '{t.name}'"
    if t.data_type != model_config_pb2.TYPE_INVALID:
        dtype = dtype_of(t.data_type, label)
        if dtype != model.dtype:
            raise ConfigError(
                f"{label}: data_type {type_name(t.data_type)} but {file} has {_NAMES.get(model.dtype, model.dtype)}"
            )
    lead = [-1] if batch > 0 else []
    if t.HasField("reshape") and not t.dims:
        raise ConfigError(f"{label}: reshape needs the dims clients send")
    dims = list(t.dims) if t.dims else list(model.shape[len(lead) :])
    for d in dims:
        if d == 0 or d < -1:
            raise ConfigError(f"{label}: dims {dims}: a dimension is a positive size or -1")
    inner = list(t.reshape.shape) if t.HasField("reshape") else dims
    full = lead + inner
    if len(full) != len(model.shape) or any(m != -1 and m != c for c, m in zip(full, model.shape)):
        what = f"reshape {inner}" if t.HasField("reshape") else f"dims {dims}"
        batched = " after the batch dimension" if batch > 0 else ""
        raise ConfigError(f"{label}: {what}{batched} does not fit {file}'s {_fmt(model.shape)}")
    if t.HasField("reshape") and inner != dims:
        _check_reshape(label, dims, inner)
        (out.input_reshape if kind == "input" else out.output_reshape)[t.name] = Reshape(api=dims, model=inner)
    elif kind == "input" and any(m == -1 and c != -1 for c, m in zip(full[len(lead) :], model.shape[len(lead) :])):
        # Narrower than the model where it keeps a size open too (dims [4, -1] of a [?, ?] model):
        # no profile can say that, so requests are checked against the dims themselves.
        out.input_reshape[t.name] = Reshape(api=dims, model=dims)
    if isinstance(t, model_config_pb2.ModelInput) and t.format != model_config_pb2.ModelInput.FORMAT_NONE:
        out.formats[t.name] = model_config_pb2.ModelInput.Format.Name(t.format)
    if kind == "input" and -1 in model.shape and -1 not in inner:
        if batch > 0:
            out.profiles[t.name] = [[1, *inner], [min(opt_batch, batch), *inner], [batch, *inner]]
        else:
            out.profiles[t.name] = [inner, inner, inner]


def _check_reshape(label: str, api: list[int], model: list[int]) -> None:
    if api.count(-1) > 1 or model.count(-1) > 1:
        raise ConfigError(f"{label}: reshape {model} of dims {api}: at most one -1 on each side, so each follows")
    if -1 not in api and -1 not in model and math.prod(api) != math.prod(model):
        raise ConfigError(f"{label}: reshape {model} holds {math.prod(model)} elements, dims {api} {math.prod(api)}")
    if (-1 in api) != (-1 in model):
        raise ConfigError(f"{label}: reshape {model} of dims {api}: a -1 on one side needs one on the other")


def _fmt(shape: Sequence[int]) -> str:
    return "[" + ", ".join("?" if d < 0 else str(d) for d in shape) + "]"
