"""The server users write by hand: FastAPI on uvicorn, the model loaded lazily on first use.

Raw tensor bytes in and out (the shape in an ``X-Shape`` header): the cheapest honest path for a
hand-written server, no JSON around the numbers. This is also the cold-start reference: nothing
is loaded or warmed before the first request.

    uvicorn bench.peer_fastapi:app --uds PATH   (BENCH_SPECS names the model list)
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import FastAPI, Request, Response

from bench.models import ModelSpec, read_specs, session

app = FastAPI()
_specs: dict[str, ModelSpec] = read_specs(Path(os.environ["BENCH_SPECS"]))
_sessions: dict[str, Any] = {}
_lock = threading.Lock()


@app.get("/health")
async def health() -> dict[str, bool]:
    return {"ok": True}


def _session(name: str) -> Any:
    sess = _sessions.get(name)
    if sess is None:
        with _lock:
            sess = _sessions.get(name)
            if sess is None:
                sess = _sessions[name] = session(_specs[name])
    return sess


@app.post("/infer/{model}")
async def infer(model: str, request: Request) -> Response:
    spec = _specs[model]
    shape = tuple(int(d) for d in request.headers["x-shape"].split(","))
    x = np.frombuffer(await request.body(), np.float32).reshape(shape)
    out = _session(model).run([spec.outputs[0]], {spec.input: x})[0]
    return Response(
        out.tobytes(), media_type="application/octet-stream", headers={"X-Shape": ",".join(map(str, out.shape))}
    )
