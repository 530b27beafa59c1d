"""The limit lane of ``overhead``: what any server on this socket stack can do for a model.

The echo lane's stack (uvicorn, uvloop, httptools, a Unix socket) with the model run on the event
loop for every request, on an input the server already holds: no request to parse, no tensor to
decode or check, no hand-off to a worker thread, no frame crossing the socket, a fixed 100-byte
answer. What is left is the socket round trip, HTTP, and the model run after the idle time a
request/response exchange puts between two runs (the in-process floor runs them back to back).
Where a target is beyond a machine, "a bare Unix socket echo plus the model run" is its bound:
this is that, measured in the same interleaved rounds as edged and the floor.

The session is built as every server's is (``bench.models.session``), warmed before the socket
is bound, so the first request finds it ready.

A second limit lane, ``limitworker``, runs the model on a worker thread instead (one thread,
asyncio's run_in_executor: the hand-off any asyncio server uses), so that the event loop stays free
during the run, as edged's must for any model that takes more than a few tens of microseconds
(nothing over a millisecond runs on its loop). The difference between the two lanes is the price
of the two thread wake-ups on this machine.

A third, ``limitv2``, is the least an Open Inference Protocol server does per request on this
stack: the real request (edged's client's binary form), its body read, decoded with edged's own
decoder (a header seen before is not parsed again), the model run on the loop on those tensors,
the answer encoded with edged's encoder; no routing, checks, statistics, metrics or scheduling. The
bound for a target that the protocol's own work, not the machine, puts out of reach: for a model
whose tensors travel in the body (tiny). A frame in the body measures the socket's copy of it
instead, which edged's clients avoid with shared memory (conv640: 5.1 ms against edged's 2.5 ms
with the producer's copy into a region, 2-core machine).

    uvicorn bench.limit:app --uds PATH        (BENCH_SPECS names the model list, BENCH_MODELS those served)
    uvicorn bench.limit:worker_app --uds PATH (the same, the model on a worker thread)
    uvicorn bench.limit:posix_app --uds PATH  (limitworker with the frame through a POSIX object)
    uvicorn bench.limit:echo_app --uds PATH   (the echo lane)

A fourth, ``limitposix``, is ``limitworker`` with a frame through the client's POSIX shared memory
object (``GET /MODEL/KEY``, the object ``/dev/shm/KEY``): on the worker thread the frame is copied
out of the object (preadv into a buffer the server keeps), the model runs on it and its answer is
copied into the object after the frame (pwrite), as a server must that may not map an object its
client can shrink; then the echo's answer. The bound for edged's frames through POSIX objects.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from bench.models import ModelSpec, read_specs, session
from edged.wire.decode import decode_infer
from edged.wire.encode import encode_infer

ANSWER = b"e" * 100
_HEAD = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"application/octet-stream"), (b"content-length", b"100")],
}


async def echo_app(scope: dict[str, Any], receive: Callable[[], Any], send: Callable[[Any], Any]) -> None:
    """The echo lane's server: reads the request, answers a fixed 100-byte body, runs nothing."""
    if scope["type"] != "http":
        return
    await _body(receive)
    await send(_HEAD)
    await send({"type": "http.response.body", "body": ANSWER})


async def _body(receive: Callable[[], Any]) -> bytes:
    """The request's body, whole (its parts joined once)."""
    message = await receive()
    parts = [message.get("body", b"")]
    while message.get("more_body"):
        message = await receive()
        parts.append(message.get("body", b""))
    return b"".join(parts)


def _run_for(scope: dict[str, Any]) -> Callable[[], Any] | None:
    """The run of the model the path names (``/MODEL``); None for "/", the readiness probe."""
    return _runs.get(scope["path"].strip("/")) if scope["type"] == "http" else None


def _models() -> tuple[dict[str, Callable[[], Any]], dict[str, Any], dict[str, ModelSpec]]:
    """Per served model, its run on the held input, its session (for limitv2 and limitposix) and
    its spec."""
    specs = read_specs(Path(os.environ["BENCH_SPECS"]))
    runs: dict[str, Callable[[], Any]] = {}
    sessions: dict[str, Any] = {}
    for name in os.environ["BENCH_MODELS"].split(","):
        spec = specs[name]
        sess = session(spec)
        feed, outs = {spec.input: spec.sample()}, [spec.outputs[0]]
        for _ in range(20):
            sess.run(outs, feed)
        runs[name] = functools.partial(sess.run, outs, feed)
        sessions[name] = sess
    return runs, sessions, specs


# The echo lane imports this module too, without models.
_runs, _sessions, _specs = _models() if "BENCH_MODELS" in os.environ else ({}, {}, {})


async def app(scope: dict[str, Any], receive: Callable[[], Any], send: Callable[[Any], Any]) -> None:
    """The limit lane's server: the model the path names (``/MODEL``) run on the loop, then the
    echo's answer."""
    run = _run_for(scope)
    if run is not None:
        run()
    await echo_app(scope, receive, send)


_worker = ThreadPoolExecutor(1, thread_name_prefix="limit-worker")
# The worker thread started, and each model run on it, before the server answers: the bound is a
# warm server's (bench first-request starts it fresh and times its first request).
for _run in _runs.values():
    for _ in range(5):
        _worker.submit(_run).result()


async def worker_app(scope: dict[str, Any], receive: Callable[[], Any], send: Callable[[Any], Any]) -> None:
    """The limitworker lane's server: ``app`` with the run on a worker thread, the loop free meanwhile."""
    run = _run_for(scope)
    if run is not None:
        await asyncio.get_running_loop().run_in_executor(_worker, run)
    await echo_app(scope, receive, send)


async def v2_app(scope: dict[str, Any], receive: Callable[[], Any], send: Callable[[Any], Any]) -> None:
    """The limitv2 lane's server: ``POST /v2/models/MODEL/infer`` decoded, run on the loop and
    encoded by edged's own protocol code, nothing else; any other path gets the echo's answer
    (the readiness probe)."""
    path = scope["path"] if scope["type"] == "http" else ""
    name = path[len("/v2/models/") : -len("/infer")] if path.startswith("/v2/models/") else ""
    sess = _sessions.get(name)
    if sess is None:
        await echo_app(scope, receive, send)
        return
    length = next((int(v) for k, v in scope["headers"] if k == b"inference-header-content-length"), None)
    req = decode_infer(await _body(receive), length)
    names = [o.name for o in req.outputs] if req.outputs else [o.name for o in sess.get_outputs()]
    answer, header_length = encode_infer(name, req, dict(zip(names, sess.run(names, req.inputs))))
    headers = [(b"content-type", b"application/octet-stream"), (b"content-length", str(len(answer)).encode())]
    if header_length is not None:
        headers.append((b"inference-header-content-length", str(header_length).encode()))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


# limitposix: per client object (its key), the descriptor and the buffer its frames are copied into.
_objects: dict[str, tuple[int, np.ndarray]] = {}


def _posix_serve(name: str, key: str) -> None:
    """On the worker: the frame out of the object, the run, the answer into the object after it."""
    spec = _specs[name]
    if key not in _objects:
        fd = os.open(f"/dev/shm/{key}", os.O_RDWR | os.O_CLOEXEC)
        _objects[key] = (fd, np.empty(spec.shape, np.float32))
    fd, frame = _objects[key]
    os.preadv(fd, [frame.data], 0)
    out = _sessions[name].run([spec.outputs[0]], {spec.input: frame})[0]
    os.pwrite(fd, np.ascontiguousarray(out).data, frame.nbytes)


async def posix_app(scope: dict[str, Any], receive: Callable[[], Any], send: Callable[[Any], Any]) -> None:
    """The limitposix lane's server: ``GET /MODEL/KEY`` served through the object ``KEY`` on the
    worker thread, then the echo's answer; any other path gets the echo's answer (readiness)."""
    name, _, key = scope["path"].strip("/").partition("/") if scope["type"] == "http" else ("", "", "")
    if name in _sessions and key and "/" not in key:
        await asyncio.get_running_loop().run_in_executor(_worker, _posix_serve, name, key)
    await echo_app(scope, receive, send)
