"""Warm the whole request path, not only the backend.

The first request after boot must cost what the thousandth does, so before READY=1 every ready
model gets real infer requests through the same ASGI app the socket serves: body parsing (JSON and
binary), validation, the scheduler's hand-off, encoding. The HTTP parser itself is already warm
from the daemon's own imports; what stays cold otherwise is edged's code and the libraries it
calls lazily.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import orjson

from edged.generation import is_language_model
from edged.metrics import uncounted
from edged.protocol import v2_datatype
from edged.registry import Registry
from edged.states import ModelState
from edged.tensors import is_bytes, json_strings, tensor_bytes
from edged.transports.http import App
from edged.warmup import warm_inputs

log = logging.getLogger(__name__)

_JSON_LIMIT = 4096  # elements: larger warm-up tensors go only through the binary path
ROUNDS = 3


def _bodies(inputs: dict[str, np.ndarray]) -> list[tuple[bytes, int | None]]:
    meta = [{"name": n, "datatype": v2_datatype(a.dtype.name), "shape": list(a.shape)} for n, a in inputs.items()]
    raws = [bytes(tensor_bytes(a)) for a in inputs.values()]
    binary_meta = [dict(m, parameters={"binary_data_size": len(r)}) for m, r in zip(meta, raws)]
    header = orjson.dumps({"id": "warmup", "inputs": binary_meta, "parameters": {"binary_data_output": True}})
    bodies: list[tuple[bytes, int | None]] = [(header + b"".join(raws), len(header))]
    if all(a.size <= _JSON_LIMIT for a in inputs.values()):
        data = [
            json_strings(a.reshape(-1), f"input '{n}'") if is_bytes(a.dtype) else a.reshape(-1)
            for n, a in inputs.items()
        ]
        doc = {"id": "warmup", "inputs": [dict(m, data=d) for m, d in zip(meta, data)]}
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
    return status


async def warm_request_path(app: App, registry: Registry) -> None:
    for rt in registry.models.values():
        if rt.state != ModelState.READY or rt.backend is None:
            continue
        if is_language_model(rt.cfg):  # the generation routes, streamed and not
            await app.generation.warm(rt.name)
            continue
        bodies = _bodies(warm_inputs(rt.backend.inputs, rt.cfg))
        for _ in range(ROUNDS):
            for body, header_len in bodies:
                status = await _call(app, rt.name, body, header_len)
                if status != 200:
                    log.warning("%s: warm-up request answered %d", rt.name, status, extra={"model": rt.name})
