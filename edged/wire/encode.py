"""Infer responses: JSON outputs, the binary tensor data extension, and outputs written to
shared memory.

A response is built as a list of parts (bytes or views of the output arrays) rather than one
joined buffer: a large binary output is then never copied at all, and a large JSON output is
serialised in slices, so that on a worker thread no single call holds the interpreter lock
for long (one 32 MB join held it for over 100 ms on a loaded 2-core machine).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, TypeAlias

import numpy as np
import orjson

from edged.errors import BadRequestError
from edged.wire.tensors import (
    InferRequest,
    OutputRequest,
    OutputResolver,
    datatype_of,
    is_bytes,
    json_strings,
    tensor_bytes,
    tensor_bytes_copy,
    wire_nbytes,
)

_JSON_OPTS = orjson.OPT_SERIALIZE_NUMPY
# A JSON part (request) or a result (response) above this many bytes is handled off the event
# loop: orjson and numpy take about a millisecond per 100-200 kB of tensor data.
OFFLOAD_BYTES = 64 * 1024
# Output values serialised per orjson call when an output's JSON is built in slices.
_JSON_SLICE = 32 * 1024

Part: TypeAlias = "bytes | memoryview"


def _dumps_values(flat: np.ndarray) -> bytes:
    """``[v0,v1,...]``. A non-finite float is written as the string "NaN", "Infinity" or
    "-Infinity", protobuf's JSON form: orjson would write null (the sign and the kind lost), and
    bare NaN (Python's json, Triton) is not JSON, so the KServe SDK and JSON.parse refuse the whole
    answer; tritonclient and the KServe SDK both turn the strings back into floats."""
    if flat.dtype.kind == "f" and not np.isfinite(flat).all():
        values = flat.astype(object)
        values[np.isnan(flat)] = "NaN"
        values[flat == np.inf] = "Infinity"
        values[flat == -np.inf] = "-Infinity"
        return orjson.dumps(values.tolist())
    return orjson.dumps(flat, option=_JSON_OPTS)


def _json_values(flat: np.ndarray) -> list[Part]:
    """``[v0,v1,...]`` as parts, one serialiser call per slice."""
    if flat.dtype == np.float16:
        flat = flat.astype(np.float32)  # orjson has no float16
    if flat.size <= _JSON_SLICE:
        return [_dumps_values(flat)]
    parts: list[Part] = [b"["]
    for start in range(0, flat.size, _JSON_SLICE):
        if start:
            parts.append(b",")
        parts.append(memoryview(_dumps_values(flat[start : start + _JSON_SLICE]))[1:-1])
    parts.append(b"]")
    return parts


def to_shm(out: OutputRequest, arr: np.ndarray, shm: OutputResolver) -> dict[str, Any]:
    """A BYTES output goes in its serialised form: the size reported is what was written."""
    assert out.shm_region is not None
    # A fixed-size output's bytes are made only to be copied (none when the worker wrote them).
    data = np.frombuffer(tensor_bytes(arr), dtype=np.uint8) if is_bytes(arr.dtype) else None
    nbytes = arr.nbytes if data is None else data.nbytes
    _check_fits(out, nbytes)
    dest = shm(out.shm_region, out.shm_offset, nbytes)
    if dest is not None:  # None: the model's worker has written it
        if data is None:
            data = np.frombuffer(tensor_bytes(arr), dtype=np.uint8)
        np.frombuffer(dest, dtype=np.uint8)[:] = data
    return {"shared_memory_region": out.shm_region, "shared_memory_byte_size": nbytes}


def _check_fits(out: OutputRequest, nbytes: int) -> None:
    if nbytes > out.shm_size:
        raise BadRequestError(
            f"output '{out.name}' needs {nbytes} bytes, region '{out.shm_region}' was given {out.shm_size}"
        )


def _json_data(name: str, flat: np.ndarray) -> Any:
    """What the small path hands orjson for one output's values."""
    if is_bytes(flat.dtype):
        return json_strings(flat, f"output '{name}'")
    return flat.astype(np.float32) if flat.dtype == np.float16 else flat  # orjson: no float16


def _wanted(req: InferRequest, results: Mapping[str, np.ndarray]) -> list[OutputRequest]:
    return req.outputs if req.outputs is not None else [OutputRequest(n, req.binary_all) for n in results]


def _output(model: str, out: OutputRequest, results: Mapping[str, np.ndarray]) -> np.ndarray:
    arr = results.get(out.name)
    if arr is None:
        raise BadRequestError(f"requested output '{out.name}' is not an output of '{model}'")
    return arr


# The JSON headers of answers whose outputs are all binary, of fixed-size types: the same bytes
# for every answer of a model's outputs of the same shapes, so they are written once, without an
# id (the document's last member, added to a copy). Past this many, all are forgotten.
_HEADERS_KEPT = 256
_headers: dict[tuple[Any, ...], bytes] = {}


def _header_key(
    model: str, version: str, req: InferRequest, wanted: list[OutputRequest], results: Mapping[str, np.ndarray]
) -> tuple[Any, ...] | None:
    """What an all-binary answer's header is known by (its model, version and each output's
    name, type and shape); None for any other answer, whose header depends on more."""
    key: list[Any] = [model, version]
    for out in wanted:
        arr = results.get(out.name)
        if arr is None or not out.binary or out.shm_region is not None or is_bytes(arr.dtype):
            return None
        key += (out.name, arr.dtype.str, arr.shape)
    return tuple(key)


def _encode_small(
    model: str, req: InferRequest, results: Mapping[str, np.ndarray], shm: OutputResolver | None, version: str = "1"
) -> tuple[bytes, int | None]:
    """The hot path: one orjson call for the whole JSON document, none for a header written
    before (``_headers``)."""
    wanted = _wanted(req, results)
    key = _header_key(model, version, req, wanted, results)
    known = None if key is None else _headers.get(key)
    if known is not None:
        if req.id:
            known = _with_id(known, req.id)
        return b"".join([known, *(results[out.name].tobytes() for out in wanted)]), len(known)
    entries: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for out in wanted:
        arr = _output(model, out, results)
        entry: dict[str, Any] = {"name": out.name, "datatype": datatype_of(arr.dtype), "shape": list(arr.shape)}
        if out.shm_region is not None and shm is not None:
            entry["parameters"] = to_shm(out, arr, shm)
        elif out.binary:
            chunks.append(tensor_bytes_copy(arr))
            entry["parameters"] = {"binary_data_size": len(chunks[-1])}
        else:
            entry["data"] = _json_data(out.name, arr.reshape(-1))
        entries.append(entry)
    doc: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": entries}
    if req.id and key is None:
        doc["id"] = req.id
    header = orjson.dumps(doc, option=_JSON_OPTS)
    if b"null" in header:  # orjson writes non-finite floats as null (rare: checked only then)
        for entry in entries:
            data = entry.get("data")
            if isinstance(data, np.ndarray) and data.dtype.kind == "f" and not np.isfinite(data).all():
                entry["data"] = orjson.Fragment(_dumps_values(data))
        header = orjson.dumps(doc, option=_JSON_OPTS)
    if key is not None and chunks:
        if len(_headers) >= _HEADERS_KEPT:
            _headers.clear()
        _headers[key] = header
    if key is not None and req.id:
        header = _with_id(header, req.id)
    if not chunks:
        return header, None
    return b"".join([header, *chunks]), len(header)


def _with_id(header: bytes, rid: str) -> bytes:
    """An answer's JSON document written without its id, with it: last, as orjson writes it."""
    return b"".join((header[:-1], b',"id":', orjson.dumps(rid), b"}"))


def encode_infer_parts(
    model: str,
    req: InferRequest,
    results: Mapping[str, np.ndarray],
    shm: OutputResolver | None = None,
    version: str = "1",
) -> tuple[list[Part], int | None]:
    """(the body as parts, header length or None when the body is plain JSON). ``model`` and
    ``version``: the name and version the client asked for (a repository model's served version)."""
    if sum(wire_nbytes(a) for a in results.values()) <= OFFLOAD_BYTES:
        body, header_length = _encode_small(model, req, results, shm, version)
        return [body], header_length
    wanted = _wanted(req, results)
    json_parts: list[Part] = [
        b'{"model_name":',
        orjson.dumps(model),
        b',"model_version":',
        orjson.dumps(version),
        b',"outputs":[',
    ]
    chunks: list[Part] = []
    for i, out in enumerate(wanted):
        arr = _output(model, out, results)
        entry: dict[str, Any] = {"name": out.name, "datatype": datatype_of(arr.dtype), "shape": list(arr.shape)}
        values: list[Part] = []
        if out.shm_region is not None and shm is not None:
            entry["parameters"] = to_shm(out, arr, shm)
        elif out.binary:
            raw = memoryview(tensor_bytes(arr))
            chunks.append(raw)
            entry["parameters"] = {"binary_data_size": raw.nbytes}
        elif is_bytes(arr.dtype):
            values = [orjson.dumps(json_strings(arr.reshape(-1), f"output '{out.name}'"))]
        else:
            values = _json_values(arr.reshape(-1))
        head = orjson.dumps(entry)
        json_parts.append(b"," if i else b"")
        if values:
            json_parts += [head[:-1], b',"data":', *values, b"}"]
        else:
            json_parts.append(head)
    json_parts.append(b"]")
    if req.id:
        json_parts += [b',"id":', orjson.dumps(req.id)]
    json_parts.append(b"}")
    if not chunks:
        return json_parts, None
    return json_parts + chunks, sum(len(p) if isinstance(p, bytes) else p.nbytes for p in json_parts)


def encode_infer(
    model: str,
    req: InferRequest,
    results: Mapping[str, np.ndarray],
    shm: OutputResolver | None = None,
    version: str = "1",
) -> tuple[bytes, int | None]:
    """(body, header length or None when the body is plain JSON)."""
    if sum(wire_nbytes(a) for a in results.values()) <= OFFLOAD_BYTES:
        return _encode_small(model, req, results, shm, version)
    parts, header_length = encode_infer_parts(model, req, results, shm, version)
    return b"".join(parts), header_length


def encode_now(
    model: str,
    req: InferRequest,
    results: Mapping[str, np.ndarray],
    shm: OutputResolver | None = None,
    version: str = "1",
) -> tuple[bytes, int | None] | None:
    """The answer as one body, encoded on the caller's thread (outputs bound for shared memory
    written through ``shm``), when it is small; None when it is not (``encode_large_async``)."""
    if sum(wire_nbytes(a) for a in results.values()) > OFFLOAD_BYTES:
        return None
    return _encode_small(model, req, results, shm, version)


async def encode_infer_async(
    model: str,
    req: InferRequest,
    results: Mapping[str, np.ndarray],
    shm: OutputResolver | None = None,
    version: str = "1",
) -> tuple[list[Part], int | None]:
    """``encode_infer_parts`` for the event loop: results above OFFLOAD_BYTES are encoded on a
    worker thread. Outputs written to shared memory stay on the loop, where the regions live."""
    small = encode_now(model, req, results, shm, version)
    if small is not None:
        return [small[0]], small[1]
    return await encode_large_async(model, req, results, shm, version=version)


async def encode_large_async(
    model: str,
    req: InferRequest,
    results: Mapping[str, np.ndarray],
    shm: OutputResolver | None = None,
    written: bool = False,
    version: str = "1",
) -> tuple[list[Part], int | None]:
    """``encode_infer_async`` for results ``encode_now`` found above OFFLOAD_BYTES (not added up
    again: a BYTES output's size is a walk of its elements). ``written``: every output bound for
    shared memory is there already (worker_writes.EarlyWrites). On the loop when what is left to do is
    small: a binary output goes out as a view of its array, so a frame-sized answer in binary or
    in shared memory costs its header, and a thread's two wake-ups would cost more (a
    detector's 1.6 MB answer: 0.55 ms of its request on a 16-core host, docs/performance.md)."""
    if _loop_cost(req, results, written) <= OFFLOAD_BYTES:
        return encode_infer_parts(model, req, results, shm, version)
    if shm is not None and any(o.shm_region for o in req.outputs or ()):
        resolved = _resolved_on_the_loop(model, req, results, shm)
        if resolved is None:
            return encode_infer_parts(model, req, results, shm, version)
        shm = resolved
    return await asyncio.to_thread(encode_infer_parts, model, req, results, shm, version)


def _loop_cost(req: InferRequest, results: Mapping[str, np.ndarray], written: bool) -> int:
    """About how many bytes encoding the answer copies or serialises: the values of JSON
    outputs, BYTES, copies into shared memory not yet made, a non-contiguous array's copy."""
    cost = 0
    for out in _wanted(req, results):
        arr = results.get(out.name)
        if arr is None:  # an error, raised by the encoder
            continue
        copied = is_bytes(arr.dtype) or not arr.flags.c_contiguous
        if out.shm_region is not None:
            cost += wire_nbytes(arr) if copied or not written else 0
        elif copied or not out.binary:
            cost += wire_nbytes(arr)
    return cost


def _resolved_on_the_loop(
    model: str, req: InferRequest, results: Mapping[str, np.ndarray], shm: OutputResolver
) -> OutputResolver | None:
    """The shared-memory destinations taken here, on the loop (region lookups and their use
    counts live there), handed to the worker thread in the order ``encode_infer_parts`` asks for
    them, so that the JSON of the other outputs is not encoded on the loop. None (encode all
    on the loop) when a BYTES output goes to shared memory: its size is known only
    once it is serialised."""
    wanted = [out for out in _wanted(req, results) if out.shm_region is not None]
    if any(is_bytes(_output(model, out, results).dtype) for out in wanted):
        return None  # before any destination is taken: the encoder takes them all, in order
    bufs: list[memoryview | None] = []
    for out in wanted:
        assert out.shm_region is not None
        arr = _output(model, out, results)
        _check_fits(out, arr.nbytes)  # as to_shm checks it, before the region is touched
        bufs.append(shm(out.shm_region, out.shm_offset, arr.nbytes))
    taken = iter(bufs)
    return lambda region, offset, size: next(taken)
