"""KServe v2 gRPC messages (Triton's grpc_service.proto) to and from edged's tensors.

A ``ModelInferRequest`` becomes the same request document an HTTP body is planned from, with
each raw input's bytes as a buffer of its own, so ``decode.decode_document`` checks it with the
same rules and the same messages as every other transport. Raw contents are read in place
(``numpy.frombuffer`` on them, taken from the message once: protobuf copies a bytes field on every
access); typed contents become one array per input.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from google.protobuf.message import Message

from edged.errors import BadRequestError
from edged.wire.encode import to_shm
from edged.wire.kserve_wire import framed
from edged.wire.proto import grpc_service_pb2 as pb
from edged.wire.tensors import (
    InferRequest,
    OutputRequest,
    OutputResolver,
    datatype_of,
    parse_dtype,
    tensor_bytes,
)

# The typed field of InferTensorContents that holds each datatype's values (FP16 and BF16 have
# none: they travel as raw contents only).
CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def parameter_value(p: pb.InferParameter) -> Any:
    """An InferParameter's value (bool, int, str or float), as JSON would have given it."""
    which = p.WhichOneof("parameter_choice")
    return None if which is None else getattr(p, which)


def parameters_of(params: Mapping[str, pb.InferParameter]) -> dict[str, Any]:
    return {k: parameter_value(v) for k, v in params.items()}


def set_parameter(params: Any, key: str, value: Any) -> None:
    """``params[key] = value`` in a protobuf map of InferParameter."""
    p = params[key]
    if isinstance(value, bool):
        p.bool_param = value
    elif isinstance(value, int):
        p.int64_param = value
    elif isinstance(value, float):
        p.double_param = value
    else:
        p.string_param = str(value)


# Typed values are converted this many at a time (about a millisecond each on a small board).
TYPED_SLICE = 16 * 1024
# The array a typed field is converted into, a slice at a time: what numpy.asarray makes of the
# field's values (Python bools, ints, floats, bytes), with room for every value of its protobuf type.
_TYPED_DTYPE: dict[str, Any] = {
    "bytes_contents": object,
    "bool_contents": np.bool_,
    "int_contents": np.int64,
    "int64_contents": np.int64,
    "uint_contents": np.int64,
    "uint64_contents": np.uint64,
    "fp32_contents": np.float64,
    "fp64_contents": np.float64,
}


def typed_contents(tensor: pb.ModelInferRequest.InferInputTensor) -> np.ndarray | None:
    """The input's typed contents as one array; None when it has none (raw or shared memory)."""
    if not tensor.HasField("contents"):
        return None
    field = CONTENTS_FIELD.get(tensor.datatype)
    if field is None:
        parse_dtype(tensor.datatype, f"input '{tensor.name}'")  # an unknown one: the decoder's words
        for name in set(CONTENTS_FIELD.values()):
            if len(getattr(tensor.contents, name)):
                raise BadRequestError(
                    f"input '{tensor.name}': {tensor.datatype} has no typed contents; send raw contents"
                )
        return None
    for name in set(CONTENTS_FIELD.values()) - {field}:
        if len(getattr(tensor.contents, name)):
            raise BadRequestError(f"input '{tensor.name}': {tensor.datatype} values belong in '{field}', not '{name}'")
    values = getattr(tensor.contents, field)
    n = len(values)
    if n <= TYPED_SLICE and field != "bytes_contents":
        return np.asarray(values)
    out = np.empty(n, dtype=_TYPED_DTYPE[field])
    for start in range(0, n, TYPED_SLICE):
        out[start : start + TYPED_SLICE] = values[start : start + TYPED_SLICE]
        if n > TYPED_SLICE:
            # Each slice is one C call that holds the GIL throughout (the conversion of a large
            # field runs on a worker thread): the event loop's thread gets it here, rather than
            # after the interpreter's switch interval or, for one call, after all of it.
            time.sleep(0)
    return out


def request_document(
    msg: pb.ModelInferRequest, raws: Sequence[bytes | memoryview] | None = None
) -> tuple[dict[str, Any], Sequence[bytes | memoryview], int]:
    """(the request as an infer document, the raw input contents in order, the number of
    typed values): what ``decode.decode_document`` plans and decodes. ``raws``: the message's raw
    contents taken out already (protobuf copies a bytes field on every access)."""
    if raws is None:
        raws = list(msg.raw_input_contents)
    inputs: list[dict[str, Any]] = []
    typed = 0
    nraw = 0
    for tensor in msg.inputs:
        params = parameters_of(tensor.parameters)
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
        values = typed_contents(tensor)
        if values is not None:
            if raws:
                # Triton's words, which its explicit-content example clients match.
                raise BadRequestError(
                    f"contents field must not be specified when using raw_input_contents for '{tensor.name}' "
                    f"for model '{msg.model_name}'"
                )
            entry["data"] = values
            typed += values.size
        elif "shared_memory_region" not in params and "binary_data_size" not in params:
            if nraw < len(raws):
                params["binary_data_size"] = len(raws[nraw])
            nraw += 1
        elif "binary_data_size" in params:
            raise BadRequestError(f"input '{tensor.name}': 'binary_data_size' is not a gRPC parameter")
        if params:
            entry["parameters"] = params
        inputs.append(entry)
    if raws and nraw != len(raws):
        raise BadRequestError(f"{len(msg.inputs)} inputs need {nraw} raw input contents, the request has {len(raws)}")
    doc: dict[str, Any] = {"inputs": inputs}
    if msg.id:
        doc["id"] = msg.id
    if msg.parameters:
        doc["parameters"] = parameters_of(msg.parameters)
    if msg.outputs:
        doc["outputs"] = [_output_doc(o) for o in msg.outputs]
    return doc, raws, typed


def _output_doc(o: pb.ModelInferRequest.InferRequestedOutputTensor) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": o.name}
    if o.parameters:
        params = parameters_of(o.parameters)
        params.pop("binary_data", None)  # every gRPC answer is raw: the HTTP switch means nothing here
        entry["parameters"] = params
    return entry


def response_parts(
    model: str,
    version: str,
    req: InferRequest,
    results: Mapping[str, np.ndarray],
    shm: OutputResolver | None = None,
) -> tuple[pb.ModelInferResponse, list[bytes | memoryview]]:
    """The answer without its raw contents, and those contents: every output's bytes (a view of
    the output where no copy is needed; tritonclient indexes them by output), or, for one bound
    for shared memory, its region and size in the message and empty raw contents."""
    resp = pb.ModelInferResponse(model_name=model, model_version=version, id=req.id)
    wanted = req.outputs if req.outputs is not None else [OutputRequest(n) for n in results]
    raws: list[bytes | memoryview] = []
    for out in wanted:
        arr = results.get(out.name)
        if arr is None:
            raise BadRequestError(f"requested output '{out.name}' is not an output of '{model}'")
        tensor = resp.outputs.add(name=out.name, datatype=datatype_of(arr.dtype), shape=arr.shape)
        if out.shm_region is not None and shm is not None:
            raws.append(b"")
            for key, value in to_shm(out, arr, shm).items():
                set_parameter(tensor.parameters, key, value)
        else:
            raws.append(tensor_bytes(arr))
    return resp, raws


def serialized_answer(resp: pb.ModelInferResponse, raws: list[bytes | memoryview], stream: bool) -> bytes:
    """``resp`` with ``raws`` as its raw_output_contents, serialized, as a ModelStreamInferResponse's
    ``infer_response`` when ``stream``: the bytes protobuf's SerializeToString gives for the whole
    message (fields in number order: the raw contents are the last field, the stream's error_message,
    empty, is left out). protobuf serializes only the small head here. Its encoder copies a large
    bytes field into buffers it grows and copies again, all under the GIL (about 0.5 s for 64 MiB
    here); each raw content is framed as the field it is (key, length, bytes) and joined in one copy."""
    return framed([resp.SerializeToString()], raws, stream)


def to_message(doc: Mapping[str, Any], cls: type[Message]) -> Message:
    """A Triton JSON document (model configuration, statistics) as its protobuf message: the
    field names are the proto's, so protobuf's JSON mapping reads it."""
    from google.protobuf import json_format

    return json_format.ParseDict(doc, cls(), ignore_unknown_fields=True)
