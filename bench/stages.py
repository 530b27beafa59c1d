"""The daemon launcher of ``first-request`` and ``overhead --stages``: ``python -m bench.stages
serve --config FILE`` runs the real daemon (edged.cli.main), with the stages of an infer request
wrapped in timers when BENCH_STAGES names a file. Nothing of this is in the product: the wrappers
are installed here, in the benchmark's own launcher, and cost the same on every request they time.

Per request, in order of the path: the ASGI call as a whole (``app``), the body read from
uvicorn (``read``), body decode with the shared-memory input buffers it allocates (``decode``),
the copy out of the client's region (``fill``: on the loop or a worker thread), the scheduler's
hand-off, run and wake-up (``infer``) and the model run alone on its worker (``run``), encoding
(``encode``), the copy into an output region (``flush``) and uvicorn's writes of the answer
(``send``, both calls). Each stage records its wall time and the minor page faults of the
thread it ran on (RUSAGE_THREAD). The records are written as JSON lines to the file named by
BENCH_STAGES when the daemon exits. BENCH_KEEP_SPINNING=1 leaves ONNX Runtime's pool spinning after
each run (ONNX Runtime's default; edged stops it), for a same-run comparison.
"""

from __future__ import annotations

import atexit
import contextvars
import functools
import json
import os
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

Record = dict[str, Any]

_current: contextvars.ContextVar[Record | None] = contextvars.ContextVar("bench_stage_request", default=None)
_done: list[Record] = []
_in_flight: list[Record] = []  # the request the loop is serving (the benchmark sends one at a time)


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def _add(rec: Record | None, stage: str, dt: float, faults: int) -> None:
    if rec is None:
        return
    end = time.perf_counter()
    ms, flt, at = rec.setdefault("ms", {}), rec.setdefault("faults", {}), rec.setdefault("at_ms", {})
    ms[stage] = ms.get(stage, 0.0) + dt * 1000
    flt[stage] = flt.get(stage, 0) + faults
    # When the stage started and ended, in ms since the request reached the app (first time only).
    at.setdefault(stage, [(end - dt - rec["t0"]) * 1000, (end - rec["t0"]) * 1000])


def _wrap_async(owner: Any, attr: str, stage: str) -> None:
    fn = getattr(owner, attr)

    @functools.wraps(fn)
    async def timed(*args: Any, **kwargs: Any) -> Any:
        rec, f0, t0 = _current.get(), _faults(), time.perf_counter()
        if rec is not None and stage in rec.setdefault("open", set()):
            return await fn(*args, **kwargs)  # inside the same stage (Service.infer trying infer_now)
        if rec is not None:
            rec["open"].add(stage)
        try:
            return await fn(*args, **kwargs)
        finally:
            if rec is not None:
                rec["open"].discard(stage)
            _add(rec, stage, time.perf_counter() - t0, _faults() - f0)

    setattr(owner, attr, timed)


def _wrap_sync(owner: Any, attr: str, stage: str, rec_of: Callable[[], Record | None]) -> None:
    fn = getattr(owner, attr)

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        rec, f0, t0 = rec_of(), _faults(), time.perf_counter()
        if rec is not None and stage in rec.get("open", ()):
            return fn(*args, **kwargs)  # inside the same stage, timed by the outer call
        try:
            return fn(*args, **kwargs)
        finally:
            _add(rec, stage, time.perf_counter() - t0, _faults() - f0)

    setattr(owner, attr, timed)


def install() -> None:
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

    from edged.backends import onnxruntime as ort_backend
    from edged.serving.service import Service
    from edged.transports.http import app as http
    from edged.transports.http import infer as http_infer
    from edged.transports.shm import copies as shm_io

    app_call = http.App.__call__

    async def app(self: Any, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or not scope.get("path", "").endswith("/infer"):
            return await app_call(self, scope, receive, send)
        rec: Record = {"path": scope["path"], "at": time.time(), "t0": time.perf_counter()}
        token = _current.set(rec)
        _in_flight.append(rec)
        f0, t0 = _faults(), time.perf_counter()
        try:
            await app_call(self, scope, receive, send)
        finally:
            _add(rec, "app", time.perf_counter() - t0, _faults() - f0)
            _current.reset(token)
            _in_flight.remove(rec)
            _done.append(rec)

    http.App.__call__ = app  # type: ignore[method-assign]
    # The infer route (edged/transports/http/infer.py) decodes, runs an inline model and encodes
    # a small request without awaiting, and awaits the async forms otherwise: both are timed.
    _wrap_sync(http_infer, "decode_now", "decode", _current.get)
    _wrap_async(Service, "decode_infer", "decode")
    _wrap_async(shm_io.ShmRequest, "fill", "fill")
    _wrap_async(shm_io.ShmRequest, "flush", "flush")
    _wrap_sync(Service, "infer_now", "infer", _current.get)
    _wrap_async(Service, "infer", "infer")
    _wrap_sync(http_infer, "encode_now", "encode", _current.get)
    _wrap_async(http_infer, "encode_large_async", "encode")
    _wrap_async(http_infer, "read_body", "read")  # the body from uvicorn (a wait, if it is still arriving)
    _wrap_async(RequestResponseCycle, "send", "send")  # uvicorn's writes of the answer's head and body
    # The copies and the model run on other threads: they find their request through the
    # context that run_in_executor and the scheduler's queue do not carry, so they record into
    # the one request in flight (the benchmark sends one at a time).
    _wrap_sync(shm_io, "_read_all", "read_copy", _latest)
    _wrap_sync(shm_io, "_write_all", "write_copy", _latest)
    _wrap_sync(ort_backend._OrtInstance, "_infer_impl", "run", _latest)
    _wrap_sync(ort_backend._OrtInstance, "_infer_into_impl", "run", _latest)  # run into a mapped region
    atexit.register(_dump)


# The hand-offs between threads, each as (name, the stage on the loop, the stage on the other thread).
HOPS = (("to copier", "fill", "read_copy"), ("to worker", "infer", "run"))


def hops(at: dict[str, list[float]]) -> dict[str, tuple[float, float]]:
    """One request's hand-offs, from its stages' start and end times (``at_ms``): name -> (ms
    from the loop's stage starting to the other thread's, ms from the other thread's ending to
    the loop's)."""
    return {
        name: (at[inner][0] - at[outer][0], at[outer][1] - at[inner][1])
        for name, outer, inner in HOPS
        if outer in at and inner in at
    }


def _latest() -> Record | None:
    return _in_flight[-1] if _in_flight else None


def _dump() -> None:
    path = os.environ.get("BENCH_STAGES")
    if path:
        with open(path, "a") as f:
            for rec in _done:
                f.write(json.dumps({k: v for k, v in rec.items() if k != "open"}) + "\n")


def keep_spinning() -> None:
    """ONNX Runtime's intra-op pool left spinning after a run returns (its default; edged's serving
    sessions set session.force_spinning_stop), for a same-run comparison."""
    from edged.backends import onnxruntime as ort_backend

    ort_backend.SERVING_CONFIG.pop("session.force_spinning_stop", None)


def main() -> int:
    if os.environ.get("BENCH_STAGES"):
        install()
    if os.environ.get("BENCH_KEEP_SPINNING") == "1":
        keep_spinning()
    from edged.cli import main as edged_main

    return edged_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
