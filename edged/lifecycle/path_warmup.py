"""Warm the whole request path, not only the backend.

The first request after boot must cost what the thousandth does, so before READY=1 every ready
model gets real infer requests through the same ASGI app the socket serves: body parsing (JSON and
binary), validation, the scheduler's hand-off, encoding; then a few through the daemon's own Unix
socket, so that the connection path (uvicorn's protocol, the HTTP parser's callbacks, the
connection limits, peer credentials) has run too. On a 2-core machine a first request that took
that path cold paid 0.3-0.5 ms more than one after the same idle gap.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from typing import Any

import numpy as np
import orjson

from edged.errors import EdgedError
from edged.llm.generation import is_language_model
from edged.serving.metrics import uncounted
from edged.serving.registry import Registry
from edged.serving.states import ModelState
from edged.serving.warmup import warm_inputs
from edged.transports.http.app import App
from edged.transports.shm.copies import warm_copies
from edged.wire.decode import v2_datatype
from edged.wire.tensors import is_bytes, json_strings, tensor_bytes_copy

log = logging.getLogger(__name__)

_JSON_LIMIT = 4096  # elements: larger warm-up tensors go only through the binary path
ROUNDS = 3
# Requests through the daemon's own socket: enough that the connection's code (answers made at
# once included) has run past the interpreter's specialisation, a millisecond each for tiny.
SOCKET_ROUNDS = 8
SOCKET_TIMEOUT_S = 10.0
# What a model's runs should add to the start in each of the two loops above (per model in
# process; once, with the cheapest model, over the socket): as many rounds as fit, and always one.
# Rounds are what make Python specialise the path's code, which is the same for every model; the
# cheap models run every round, and a costly one pays for cold code a few tenths of a millisecond,
# a fraction of a percent of its run. On the 2-core machine the PP-OCRv4 detector (117 ms a run)
# ran six times here, 0.7 s of a 1.9-2.6 s start; now twice. (A model that runs inline runs twice
# per body, through the app and at once: such a model is far under the budget.)
PATH_BUDGET_US = 50_000.0
PLANNING_ROUNDS = 16
PLANNING_BODY_MAX = 64 * 1024  # larger warm-up bodies: planning is warmed by the smaller models


def rounds_within(infer_us: float | None, runs_per_round: int, most: int) -> int:
    """How many rounds of ``runs_per_round`` runs fit in PATH_BUDGET_US (at least one, at most
    ``most``); ``most`` when the run's cost is unknown."""
    if infer_us is None or not math.isfinite(infer_us) or infer_us <= 0:
        return most
    return max(1, min(most, int(PATH_BUDGET_US // (infer_us * runs_per_round))))


def _bodies(
    inputs: dict[str, np.ndarray], outputs: list[str], tag: int | None = None, ident: bool = True
) -> list[tuple[bytes, int | None]]:
    """The warm-up's request bodies; ``tag``: a request parameter that makes the header one the
    plan cache has not seen (an id would not: headers that differ only in their id share a plan);
    ``ident``: with an id (a header without one is its own key in the plan cache)."""
    meta = [{"name": n, "datatype": v2_datatype(a.dtype.name), "shape": list(a.shape)} for n, a in inputs.items()]
    raws = [tensor_bytes_copy(a) for a in inputs.values()]
    binary_meta = [dict(m, parameters={"binary_data_size": len(r)}) for m, r in zip(meta, raws)]
    data = b"".join(raws)
    bodies: list[tuple[bytes, int | None]] = []
    # Binary, all outputs; then binary naming its outputs, as edged's and Triton's clients send it
    # (the requested-outputs path of decoding and encoding is otherwise first run by a client).
    named = [{"name": n, "parameters": {"binary_data": True}} for n in outputs]
    for extra in ({}, {"outputs": named}):
        params: dict[str, Any] = {"binary_data_output": True}
        if tag is not None:
            params["warmup"] = tag
        doc: dict[str, Any] = {"inputs": binary_meta, "parameters": params}
        if ident:  # where edged's client writes it: its numbered requests find the id's template
            doc["id"] = "warmup"
        doc.update(extra)
        header = orjson.dumps(doc)
        bodies.append((header + data, len(header)))
    if all(a.size <= _JSON_LIMIT for a in inputs.values()):
        values = [
            json_strings(a.reshape(-1), f"input '{n}'") if is_bytes(a.dtype) else a.reshape(-1)
            for n, a in inputs.items()
        ]
        doc = {"id": "warmup", "inputs": [dict(m, data=d) for m, d in zip(meta, values)]}
        bodies.append((orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY), None))
    return bodies


async def _call(app: App, model: str, body: bytes, header_len: int | None) -> int:
    headers = [(b"content-length", str(len(body)).encode())]
    if header_len is not None:
        headers.append((b"inference-header-content-length", str(header_len).encode()))
    scope: dict[str, Any] = {"type": "http", "method": "POST", "path": f"/v2/models/{model}/infer", "headers": headers}
    status = 0

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    with uncounted():  # the daemon's own requests are not traffic
        await app(scope, receive, send)
        # And as the connection answers it at once (App.wants/now), where it would: that path's
        # code is then not first run by a client's request.
        name = app.wants(scope)
        answer = None if name is None else app.now(scope, body, name)
        if isinstance(answer, tuple):
            status = answer[0]
        elif answer is not None:  # the rest of the answer, an ASGI app
            await answer(scope, receive, send)
    return status


async def _over_socket(path: str, model: str, body: bytes, header_len: int | None) -> int:
    """One infer request through the daemon's own socket, as a client sends it: uvicorn's
    protocol, the HTTP parser's callbacks, the connection's limits and peer credentials, which the
    in-process calls above never reach. Answered uncounted (http.App knows its own pid)."""
    reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), SOCKET_TIMEOUT_S)
    try:
        extra = f"Inference-Header-Content-Length: {header_len}\r\n" if header_len is not None else ""
        head = (
            f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: localhost\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
        )
        writer.write(head.encode() + body)
        status = int((await asyncio.wait_for(reader.readline(), SOCKET_TIMEOUT_S)).split()[1])
        length = 0
        while (line := await asyncio.wait_for(reader.readline(), SOCKET_TIMEOUT_S)) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        await asyncio.wait_for(reader.readexactly(length), SOCKET_TIMEOUT_S)
        return status
    finally:
        writer.close()


async def _warm_planning(app: App, model: str, inputs: dict[str, np.ndarray], outputs: list[str]) -> None:
    """Decode (no run) headers the plan cache has not seen, PLANNING_ROUNDS of them: the requests
    above hit the cache after their first, so the planning code ran only a few times, and a
    client's first request (whose header is new) ran it cold: 0.12-0.25 ms more in decoding on
    the 2-core machine (Python specialises a function only after it has run several times).

    Then, last (the most recent in the plan cache), the binary headers without an id, which the
    cache keeps under their own bytes: what edged's client sends by default
    (edged.client.encode_request), with or without named outputs. Its first request then finds
    its plan instead of planning it (27 us warm on the 2-core machine, 0.07-0.09 ms after an idle
    gap); the warm-up's requests above carry an id, so they plan the client's headers that carry
    one. Only for small bodies, as the rounds: for a frame in the body, planning is a few hundredths
    of the request, and building its bodies again would cost the start milliseconds and memory."""
    tagged = (_bodies(inputs, outputs, i)[1] for i in range(PLANNING_ROUNDS))  # one body at a time
    for body, header_len in itertools.chain(tagged, _bodies(inputs, outputs, ident=False)[:2]):
        try:
            await app.service.decode_infer(model, body, header_len)
        except Exception as e:  # a warm-up step that cannot run costs a first request, not the start
            log.warning("%s: warming the request planning failed: %s", model, e, extra={"model": model})
            return


async def _warm_sockets(paths: list[str], model: str, body: tuple[bytes, int | None], rounds: int) -> None:
    """A binary request naming its outputs (what clients send), on a new connection each round."""
    for path in paths:
        try:
            for _ in range(rounds):
                status = await _over_socket(path, model, *body)
                if status != 200:
                    log.warning("%s: warm-up through %s answered %d", model, path, status, extra={"model": model})
            log.debug("%s: warmed the connection path through %s", model, path, extra={"model": model})
        except (OSError, ValueError, IndexError, asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
            # A socket path that cannot be warmed costs a first request, not the start.
            log.warning("%s: the socket path %s was not warmed: %s", model, path, e, extra={"model": model})


async def warm_request_path(app: App, registry: Registry, sockets: list[str] | None = None) -> int:
    """Warm every ready model's request path; returns the largest request body sent (bytes), for
    heap.settle to keep faulted in."""
    largest_body = 0
    largest = 0  # the largest input a model takes: the size of the shared-memory copy to warm
    # The connection path is the same for every model: it is warmed with the cheapest one, so
    # that a start with a 100 ms detector does not run it again for this.
    cheapest: tuple[float, str, tuple[bytes, int | None]] | None = None
    for rt in registry.models.values():
        if rt.state != ModelState.READY or rt.backend is None:
            continue
        if is_language_model(rt.cfg):  # the generation routes, streamed and not
            # Uncounted, as every request of the warm-up: a counted one waits for READY=1, which
            # waits for it (each was answered 503 after its timeout, 10-20 s a route).
            with uncounted():
                await app.generation.warm(rt.name)
            continue
        inputs = app.service.as_sent(rt, warm_inputs(rt.backend.inputs, rt.cfg))
        largest = max([largest, *(a.nbytes for a in inputs.values())])
        names = [o.name for o in rt.backend.outputs]
        bodies = _bodies(inputs, names)
        largest_body = max([largest_body, *(len(b) for b, _ in bodies)])
        for _ in range(rounds_within(rt.infer_us, len(bodies), ROUNDS)):
            for body, header_len in bodies:
                status = await _call(app, rt.name, body, header_len)
                if status != 200:
                    log.warning("%s: warm-up request answered %d", rt.name, status, extra={"model": rt.name})
        cost = rt.infer_us if rt.infer_us is not None else float("inf")
        if cheapest is None or cost < cheapest[0]:
            cheapest = (cost, rt.name, bodies[1])
        if len(bodies[1][0]) <= PLANNING_BODY_MAX:
            await _warm_planning(app, rt.name, inputs, names)
    if cheapest is not None:
        cost, name, cheap_body = cheapest
        await _warm_sockets(sockets or [], name, cheap_body, rounds_within(cost, 1, SOCKET_ROUNDS))
    # Frames arrive through shared memory: the copy path (its threads, preadv, pwrite) is not on
    # the path of the requests above, which carry their tensors in the body.
    try:
        for _ in range(ROUNDS):
            await warm_copies(largest)
    except (OSError, EdgedError) as e:  # a warm-up that cannot run costs a first frame, not the start
        log.warning("the shared memory copy path was not warmed: %s", e)
    return largest_body
