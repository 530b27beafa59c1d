"""A model file's own tensors: what config.pbtxt's inputs and outputs are checked against.

An ONNX model's graph says its inputs and outputs (read without its weights' external data);
a GGUF is served through edged's generation tensors, ``text_input`` and ``text_output``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edged.errors import ConfigError, EdgedError
from edged.llm.generation import INPUT, OUTPUT
from edged.llm.gguf_header import read_header

# ONNX's TensorProto element types, as numpy names ("object": strings, BYTES on the wire).
_ONNX_TYPES = {
    1: "float32",
    2: "uint8",
    3: "int8",
    4: "uint16",
    5: "int16",
    6: "int32",
    7: "int64",
    8: "object",
    9: "bool",
    10: "float16",
    11: "float64",
    12: "uint32",
    13: "uint64",
    16: "bfloat16",
}


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str  # numpy's name; "object" for strings
    shape: tuple[int, ...]  # -1: a dimension of any size


@dataclass(frozen=True)
class Signature:
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]


def onnx_signature(path: Path) -> Signature:
    import onnx  # only a repository with ONNX models needs it (about 100 ms to import)

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # a truncated or foreign file: onnx raises protobuf's and its own errors
        raise ConfigError(f"{path}: not an ONNX model: {e.__class__.__name__}: {e}") from None
    graph = model.graph
    weights = {t.name for t in graph.initializer}  # models before IR 4 list them as inputs too
    inputs = tuple(_tensor(path, v) for v in graph.input if v.name not in weights)
    return Signature(inputs, tuple(_tensor(path, v) for v in graph.output))


def _tensor(path: Path, value: object) -> Tensor:
    name: str = value.name  # type: ignore[attr-defined]
    ttype = value.type  # type: ignore[attr-defined]
    if ttype.WhichOneof("value") != "tensor_type":
        raise ConfigError(f"{path}: tensor '{name}' is not a tensor (a sequence or a map), which edged cannot serve")
    elem = ttype.tensor_type.elem_type
    if elem not in _ONNX_TYPES:
        raise ConfigError(f"{path}: tensor '{name}' has ONNX element type {elem}, which edged cannot serve")
    dims = ttype.tensor_type.shape.dim
    shape = tuple(d.dim_value if d.WhichOneof("value") == "dim_value" and d.dim_value > 0 else -1 for d in dims)
    return Tensor(name, _ONNX_TYPES[elem], shape)


def gguf_signature(path: Path) -> Signature:
    """A language model's tensors in edged: one prompt (or chat) in, one text out."""
    try:
        read_header(str(path))
    except EdgedError as e:
        raise ConfigError(e.message) from None
    return Signature((Tensor(INPUT, "object", (1,)),), (Tensor(OUTPUT, "object", (1,)),))
