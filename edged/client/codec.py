"""Encoding a request and decoding a response or an error body, as edged's clients send and read them.

Requests use the Open Inference Protocol with the binary tensor extension: a JSON header, then
each tensor's raw bytes. Responses are read in the same form, or with tensors as JSON data. An
error body's stable ``code`` picks the daemon's own exception class (``edged.errors``). Nothing
here opens a connection, so the blocking and the asyncio client share it, and so can a program
that moves the bytes itself.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import orjson

from edged import errors
from edged.client.shm import ShmTensor
from edged.wire.decode import V2_TO_NUMPY
from edged.wire.tensors import datatype_of, from_bytes, from_json_data, is_bytes, tensor_bytes

_ERRORS = {code: wire.cls for code, wire in errors.wire_codes().items()}


def raise_for(status: int, body: bytes) -> None:
    if status < 400:
        return
    try:
        doc = orjson.loads(body)
        message, code = str(doc.get("error", "")), str(doc.get("code", ""))
    except (orjson.JSONDecodeError, AttributeError):
        message, code = body.decode(errors="replace"), ""
    cls = _ERRORS.get(code, errors.EdgedError)
    raise cls(f"{message} (HTTP {status})")


def encode_request(
    inputs: Mapping[str, np.ndarray | ShmTensor],
    outputs: Sequence[str] | None = None,
    request_id: str = "",
    binary_outputs: bool = True,
) -> tuple[bytes, dict[str, str]]:
    metas: list[dict[str, Any]] = []
    chunks: list[bytes | memoryview] = []
    for name, value in inputs.items():
        if isinstance(value, ShmTensor):
            metas.append(value.meta(name))
            continue
        arr = np.asarray(value)
        raw = tensor_bytes(arr)  # BYTES (object, bytes_ or str_ arrays): length-prefixed elements
        metas.append(
            {
                "name": name,
                "datatype": datatype_of(arr.dtype),
                "shape": list(arr.shape),
                "parameters": {"binary_data_size": len(raw) if isinstance(raw, bytes) else raw.nbytes},
            }
        )
        chunks.append(raw)
    doc: dict[str, Any] = {"inputs": metas, "parameters": {"binary_data_output": binary_outputs}}
    if request_id:
        doc["id"] = request_id
    if outputs is not None:
        doc["outputs"] = [{"name": n, "parameters": {"binary_data": binary_outputs}} for n in outputs]
    header = orjson.dumps(doc)
    headers = {"Content-Type": "application/octet-stream" if chunks else "application/json"}
    if chunks:
        headers["Inference-Header-Content-Length"] = str(len(header))
    return b"".join([header, *chunks]), headers


def _load_json(raw: memoryview) -> Any:
    """edged writes non-finite outputs as the strings "NaN", "Infinity", "-Infinity" (numpy reads
    them back as floats); a server that writes them bare, as Triton does, is read with json."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(bytes(raw))


def decode_response(body: bytes, header_len: int | None) -> dict[str, np.ndarray]:
    view = memoryview(body)
    doc = _load_json(view[:header_len] if header_len is not None else view)
    binary = view[header_len:] if header_len is not None else view[:0]
    out: dict[str, np.ndarray] = {}
    offset = 0
    for o in doc.get("outputs", []):
        dtype = np.dtype(V2_TO_NUMPY[o["datatype"]])
        shape = tuple(o["shape"])
        params = o.get("parameters") or {}
        where = f"output '{o['name']}'"
        if "binary_data_size" in params:
            size = params["binary_data_size"]
            out[o["name"]] = from_bytes(binary[offset : offset + size], dtype, shape, where)
            offset += size
        elif "data" in o and is_bytes(dtype):  # BYTES as JSON strings: their UTF-8 bytes, as in binary
            out[o["name"]] = from_json_data(o["data"], dtype, shape, where)
        elif "data" in o:
            out[o["name"]] = np.asarray(o["data"], dtype=dtype).reshape(shape)
    return out
