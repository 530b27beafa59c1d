"""Large JSON request parts, parsed in a child process.

orjson holds the interpreter lock for a whole parse (3-7 ms per MB on a small board, 50 ms and
more for 8 MiB, several times that while the machine is busy), and converting its lists to arrays
holds it too: on a worker thread that still stalls the event loop. A child process does not. It
runs ``python -m edged.wire.jsonchild``, is started on first use and again if it dies; the daemon sends
it the request's limits and JSON part, and it answers with the document (its inputs' data taken
out) and each JSON input's array as raw bytes, or with the error the daemon would have raised.
Frames are an 8-byte little-endian length and the bytes: nothing is pickled.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import signal
import struct
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

import numpy as np
import orjson

from edged.errors import EdgedError, UnavailableError, wire_codes
from edged.wire.decode import (
    DEFAULT_LIMITS,
    OFFLOAD_BYTES,
    InferRequest,
    Limits,
    ParsedBody,
    ShmResolver,
    check_json_part,
    decode_binary_bytes,
    decode_infer,
    finish_decode,
    parse_body,
)
from edged.wire.jsondoc import load_json
from edged.wire.plans import plan_document
from edged.wire.tensors import deserialize_bytes, from_json_data, is_bytes, tensor_bytes

_LEN = struct.Struct("<Q")
_BYTES = "BYTES"  # the dtype a BYTES array is sent under
Frame = bytes | memoryview


def _write(out: IO[bytes], frame: Frame) -> None:
    out.write(_LEN.pack(len(frame) if isinstance(frame, bytes) else frame.nbytes))
    out.write(frame)


def _read(inp: IO[bytes]) -> bytes:
    head = inp.read(_LEN.size)
    if len(head) < _LEN.size:
        raise EOFError("the other end closed the pipe")
    (size,) = _LEN.unpack(head)
    data = inp.read(size)
    if len(data) < size:
        raise EOFError("the other end closed the pipe mid-frame")
    return data


# --- the child ---------------------------------------------------------------------------------


def _handle(limits_raw: bytes, part: bytes) -> list[Frame]:
    try:
        raw = orjson.loads(limits_raw)
        if raw.get("bytes_inputs") is not None:
            raw["bytes_inputs"] = frozenset(raw["bytes_inputs"])
        limits = Limits(**raw)
        doc = load_json(part)
        plan = plan_document(doc, limits)
        arrays = [
            from_json_data(p.data, p.dtype, p.shape, f"input '{p.name}'") for p in plan.inputs if p.kind == "json"
        ]
    except EdgedError as e:
        return [orjson.dumps({"error": e.message, "code": e.code})]
    for inp in doc["inputs"]:  # checked by plan_document: a list of objects
        if "data" in inp:
            inp["data"] = None  # the daemon gets the array itself
    # A BYTES array crosses in its length-prefixed form, never as object pointers.
    meta = orjson.dumps(
        {"doc": doc, "arrays": [[_BYTES if is_bytes(a.dtype) else a.dtype.str, list(a.shape)] for a in arrays]}
    )
    return [meta, *(tensor_bytes(a) for a in arrays)]


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when this process ends
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            limits_raw, part = _read(inp), _read(inp)
        except EOFError:
            return  # the daemon closed the pipe or exited
        for frame in _handle(limits_raw, part):
            _write(out, frame)
        out.flush()


# --- the daemon's side -------------------------------------------------------------------------


class _Child:
    """One child, one request at a time (large JSON is the slow path; binary and shared memory
    are the fast ones). Called from worker threads: pipe reads and writes release the lock."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def _started(self) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            # Run from the folder holding this edged package, so the child runs the same code.
            root = Path(__file__).resolve().parent.parent
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "edged.wire.jsonchild"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=root
            )
        return self._proc

    def call(self, limits: Limits, part: memoryview) -> tuple[dict[str, Any], list[bytes]]:
        with self._lock:
            proc = self._started()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                _write(proc.stdin, orjson.dumps(dataclasses.asdict(limits), default=sorted))
                _write(proc.stdin, part)
                proc.stdin.flush()
                meta = orjson.loads(_read(proc.stdout))
                blobs = [_read(proc.stdout) for _ in meta.get("arrays", ())]
            except (OSError, EOFError, ValueError) as e:
                self.stop()
                raise UnavailableError("the JSON decoder process failed; retry the request") from e
        return meta, blobs

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()  # the child exits at the end of its input
        try:
            proc.wait(2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# The thread that talks to the child (its pipe carries one request at a time).
_CALLERS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edged-json-child")
_CHILD = _Child()
atexit.register(_CHILD.stop)


def parse_in_child(body: bytes | memoryview, header_length: int | None, limits: Limits) -> ParsedBody:
    """``protocol.parse_body`` with the parsing done by the child (blocking: call it from a
    worker thread). The same checks, the same errors."""
    end = check_json_part(body, header_length, limits)
    view = memoryview(body)
    meta, blobs = _CHILD.call(limits, view[:end])
    if "error" in meta:
        entry = wire_codes().get(str(meta.get("code")))
        raise (entry.cls if entry else EdgedError)(str(meta["error"]))
    plan = plan_document(meta["doc"], limits)
    json_inputs = [p for p in plan.inputs if p.kind == "json"]
    arrays = {
        p.name: deserialize_bytes(blob, tuple(shape), f"input '{p.name}'")
        if dt == _BYTES
        else np.frombuffer(blob, dtype=np.dtype(dt)).reshape(shape)
        for p, blob, (dt, shape) in zip(json_inputs, blobs, meta["arrays"])
    }
    binary = view[end:]
    decode_binary_bytes(plan, binary, arrays)
    return ParsedBody(plan, None, binary, arrays)


if __name__ == "__main__":
    main()


async def decode_infer_async(
    body: bytes | memoryview,
    header_length: int | None = None,
    shm: ShmResolver | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> InferRequest:
    """``decode_infer`` for the event loop. Small requests stay on the fast path; a JSON part
    above OFFLOAD_BYTES is parsed in a child process (below), because parsing holds
    the interpreter lock (a worker thread would still stall the loop for as long)."""
    json_part = len(body) if header_length is None else min(header_length, len(body))
    if json_part <= OFFLOAD_BYTES:
        header = bytes(memoryview(body)[:json_part]) if len(body) - json_part > OFFLOAD_BYTES else b""
        if b'"BYTES"' in header or b"\\u" in header:
            # Large BYTES tensors in the binary part: their framing is walked element by element.
            # A datatype spelt with escapes ("\\u0042YTES") is the same datatype to the parser.
            parsed = await asyncio.to_thread(parse_body, body, header_length, limits)
            return finish_decode(parsed, shm)
        return decode_infer(body, header_length, shm, limits)
    # On a thread of its own: the child parses one document at a time, so callers queue here as
    # futures instead of each holding a thread of the loop's default executor (metrics, probes).
    parsed = await asyncio.get_running_loop().run_in_executor(_CALLERS, parse_in_child, body, header_length, limits)
    return finish_decode(parsed, shm)
