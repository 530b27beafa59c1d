"""edged's app in process: what one tiny request costs from the ASGI call to its answer, beside
the least a V2 server does with it (the fused path), so that a change to the request path can be
measured on a noisy host, where two daemons of the same code differ by 20% end to end.

Each child process starts the daemon of one tree in process (the tiny model, one intra-op thread,
its socket in a temporary folder), waits for readiness, then calls the daemon's ASGI app with the
bench client's binary tiny request, in blocks alternated with the fused path (the body message
taken as it is, edged's decoder, the model's run, edged's encoder and the two sends, and nothing
else: no headers read, no checks, statistics, metrics or routing; leaner than the fused trial of
bench/trials/fused, which reads the body and its headers as the app does). The connection layer
(uvicorn, the socket) is not in either. The fused path is the same code in both trees, so its
figure shows each child's noise: compare the app's own times as well as its cost above it. Per
child it prints the medians of both, the app's cost above the fused path, and the Python lines
each runs for one request (a count that no noise moves). Children of this tree and of ``--base``
are alternated.

    scripts/bench.sh app [--base COMMIT|FOLDER] [--processes 4] [--requests 40000] [--functions 20]
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "data" / "models" / "tiny.onnx"
BLOCKS = 20  # per path, alternated
DEADLINE_S = 120.0
Call = Callable[[], Awaitable[None]]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="bench app", description=__doc__.split("\n")[0])
    ap.add_argument("--base", help="a commit, or a folder holding an edged/, to measure beside this tree")
    ap.add_argument("--processes", type=int, default=4, help="child processes per tree, alternated")
    ap.add_argument("--requests", type=int, default=40000, help="requests per path in each child")
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "app.json")
    ap.add_argument("--functions", type=int, default=0, help="print the N functions running most lines")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.requests)
        return
    if not MODEL.exists():
        from bench.models import demo_onnx

        demo_onnx(REPO / "data")
    trees: dict[str, Path] = {"edged": REPO}
    if args.base:
        from bench.overhead import export  # a commit or a folder, as overhead --base takes it

        base = Path(tempfile.mkdtemp(prefix="edged-app-base-"))
        export(args.base, base)
        trees["base"] = base
    try:
        runs = _alternate(trees, args.processes, args.requests)
    finally:
        if "base" in trees:
            shutil.rmtree(trees["base"], ignore_errors=True)
    if args.functions:
        for label, rs in runs.items():
            for path in ("app", "conn"):
                top = list(rs[-1][f"{path}_functions"].items())[: args.functions]
                print(f"{label} {path}: lines per function, one request: " + ", ".join(f"{k} {v}" for k, v in top))
    summary = {label: _summary(rs) for label, rs in runs.items()}
    for label, s in summary.items():
        print(
            f"{label:6} median of {args.processes}: app {s['app_us']:.1f} us, fused {s['fused_us']:.1f} us, "
            f"above fused {s['above_us']:.1f} us ({s['ratio']:.2f}x fused), lines {s['app_lines']:.0f}; "
            f"on a connection {s['conn_us']:.1f} us, lines {s['conn_lines']:.0f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"cores": len(os.sched_getaffinity(0)), "requests": args.requests, "runs": runs, "summary": summary}
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"written to {args.out}")


def _alternate(trees: dict[str, Path], processes: int, requests: int) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in trees}
    for i in range(processes):
        for label, tree in trees.items() if i % 2 == 0 else reversed(trees.items()):
            res = _spawn(tree, requests)
            runs[label].append(res)
            print(
                f"{label:6} app {res['app_us']:7.1f} us  fused {res['fused_us']:6.1f} us  "
                f"above fused {res['app_us'] - res['fused_us']:6.1f} us  lines {res['app_lines']:.0f} "
                f"(fused {res['fused_lines']:.0f})  connection {res['conn_us']:6.1f} us  lines {res['conn_lines']:.0f}",
                flush=True,
            )
    return runs


def _summary(rs: list[dict[str, Any]]) -> dict[str, float]:
    app = statistics.median(r["app_us"] for r in rs)
    fused = statistics.median(r["fused_us"] for r in rs)
    above = statistics.median(r["app_us"] - r["fused_us"] for r in rs)
    conn = statistics.median(r["conn_us"] for r in rs)
    return {
        "app_us": app,
        "fused_us": fused,
        "above_us": above,
        "ratio": app / fused,
        "app_lines": rs[0]["app_lines"],
        "conn_us": conn,
        "conn_lines": rs[0]["conn_lines"],
    }


def _spawn(tree: Path, requests: int) -> dict[str, Any]:
    from bench.overhead import tree_boot  # the parent's only: the child imports no bench module

    # Not ``-m`` (it puts the working directory ahead of the tree measured); this file runs by its
    # path, so a base that is a whole checkout brings its edged, never its bench.
    boot = tree_boot("script = sys.argv.pop(1); sys.argv[0] = 'app_cost'; runpy.run_path(script, run_name='__main__')")
    cmd = [sys.executable, "-c", boot, str(tree), __file__, "--requests", str(requests), "--child"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=DEADLINE_S * 3, check=False)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise RuntimeError(f"child for {tree} ran past {DEADLINE_S * 3:.0f} s: {err[-2000:]}") from None
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            result: dict[str, Any] = json.loads(line)
            return result
    raise RuntimeError(f"child for {tree} gave no result (exit {done.returncode}): {done.stderr[-2000:]}")


def child(requests: int) -> None:
    """In the child: edged is already the measured tree's (``tree_boot`` checked it)."""
    try:  # the daemon's own loop (edged.lifecycle.daemon.serve)
        import uvloop

        run: Callable[[Any], Any] = uvloop.run
    except ImportError:
        run = asyncio.run
    tmp = Path(tempfile.mkdtemp(prefix="edged-app-"))
    try:
        run(_in_daemon(tmp, requests))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


async def _in_daemon(tmp: Path, requests: int) -> None:
    import logging

    from edged.config import from_mapping
    from edged.lifecycle.daemon import Daemon

    logging.disable(logging.WARNING)
    raw = {
        # Inline whatever the warm-up measures on a busy host: the fused path compares only then
        "server": {"socket": str(tmp / "edged.sock"), "inline_threshold_us": 10**7},
        "cache": {"dir": str(tmp / "cache")},
        "models": {"tiny": {"path": str(MODEL), "threads": 1}},
    }
    daemon = Daemon(from_mapping(raw))
    serving = asyncio.get_running_loop().create_task(daemon.run())
    deadline = time.monotonic() + DEADLINE_S
    while getattr(daemon, "app", None) is None or not daemon.service.ready.is_set():
        if serving.done() or time.monotonic() > deadline:
            raise RuntimeError("the daemon did not become ready")
        await asyncio.sleep(0.01)
    app_call, fused_call = _paths(daemon)
    calls = {"app": app_call, "fused": fused_call, "conn": await _connection(daemon, _request(daemon)[0])}
    for _ in range(2000):
        for call in calls.values():
            await call()
    times: dict[str, list[float]] = {key: [] for key in calls}
    per = max(1, requests // BLOCKS)
    for b in range(BLOCKS):
        order = list(calls.items())
        for key, call in order if b % 2 == 0 else order[::-1]:
            t = time.perf_counter()
            for _ in range(per):
                await call()
            times[key].append((time.perf_counter() - t) / per * 1e6)
    result: dict[str, Any] = {f"{key}_us": statistics.median(ts) for key, ts in times.items()}
    result["fused_lines"] = await _lines(fused_call)
    for key in ("app", "conn"):
        where: dict[str, int] = {}
        result[f"{key}_lines"] = await _lines(calls[key], where)
        result[f"{key}_functions"] = dict(sorted(where.items(), key=lambda kv: -kv[1]))
    print(json.dumps(result), flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    os._exit(0)  # not the daemon's drain: the figures are out


def _request(daemon: Any) -> tuple[bytes, bytes]:
    """The bench client's binary tiny request, whole (head and body), and its header part."""
    import numpy as np
    import orjson

    spec = daemon.service.registry.models["tiny"].inputs[0]
    shape = [max(d, 1) for d in spec.shape]
    x = np.linspace(-1, 1, int(np.prod(shape)), dtype=np.float32).reshape(shape)
    doc = {
        "inputs": [
            {"name": spec.name, "datatype": "FP32", "shape": shape, "parameters": {"binary_data_size": x.nbytes}}
        ],
        "parameters": {"binary_data_output": True},
    }
    header = orjson.dumps(doc)
    body = header + x.tobytes()
    head = (
        f"POST /v2/models/tiny/infer HTTP/1.1\r\nhost: localhost\r\ncontent-length: {len(body)}\r\n"
        f"inference-header-content-length: {len(header)}\r\n\r\n"
    )
    return head.encode() + body, header


async def _connection(daemon: Any, request: bytes) -> Call:
    """The whole request on a connection of the daemon's own protocol (as its listener makes it),
    fed from a transport that only counts what is written: the bytes in, the answer out."""
    import socket

    from edged.transports.http import connection
    from edged.transports.peer import Door

    sock, peer = socket.socketpair()  # the protocol reads the peer's credentials from it
    server = daemon.server
    gate = connection.Gate(connection.ConnectionLimits.from_config(daemon.cfg))
    kw: dict[str, Any] = {"gate": gate, "door": Door("bench")}
    if "direct" in inspect.signature(connection.EdgedProtocol.__init__).parameters or hasattr(
        connection.EdgedProtocol, "_keep"
    ):
        kw["direct"] = daemon.app  # answers made at once, where the tree has them
    loop = asyncio.get_running_loop()
    proto = connection.EdgedProtocol(
        config=server.config, server_state=server.server_state, app_state={}, _loop=loop, **kw
    )
    out = _Counting(sock)
    proto.connection_made(out)
    proto.data_received(request)
    while not out.whole():
        await asyncio.sleep(0)
    want, out.keep = out.written, False

    async def conn_call() -> None:
        out.written = 0
        proto.data_received(request)
        while out.written < want:  # answered at once: no turn of the loop
            await asyncio.sleep(0)

    conn_call.keep = (sock, peer)  # type: ignore[attr-defined]
    return conn_call


class _Counting(asyncio.Transport):
    """A transport that counts the bytes written (the first answer parsed, to know its size)."""

    def __init__(self, sock: Any) -> None:
        super().__init__()
        self.sock, self.written, self.first, self.keep = sock, 0, b"", True

    def whole(self) -> bool:
        head, sep, body = self.first.partition(b"\r\n\r\n")
        length = next(
            (int(v) for k, _, v in (h.partition(b": ") for h in head.split(b"\r\n")) if k == b"content-length"), -1
        )
        return bool(sep) and len(body) >= length >= 0

    def write(self, data: Any) -> None:
        self.written += len(data)
        if self.keep:  # the first answer only
            self.first += bytes(data)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"socket": self.sock, "peername": "", "sockname": "bench"}.get(name, default)

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        return None

    def pause_reading(self) -> None:
        return None

    def resume_reading(self) -> None:
        return None

    def get_write_buffer_size(self) -> int:
        return 0


def _paths(daemon: Any) -> tuple[Call, Call]:
    """The app's call and the fused path's, both on the same request and the same instance."""
    from edged.wire.decode import decode_infer
    from edged.wire.encode import _encode_small

    svc = daemon.service
    rt = svc.registry.models["tiny"]
    request, header = _request(daemon)
    body = request.partition(b"\r\n\r\n")[2]
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v2/models/tiny/infer",
        "headers": [
            (b"host", b"localhost"),
            (b"content-length", str(len(body)).encode()),
            (b"inference-header-content-length", str(len(header)).encode()),
        ],
        "http_version": "1.1",
        "query_string": b"",
    }
    message = {"type": "http.request", "body": body, "more_body": False}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return message

    async def send(m: dict[str, Any]) -> None:
        sent.append(m)

    app = daemon.app
    plan_for = getattr(svc, "plan_for", None) or svc._plan_for  # the name before the flat route
    limits = plan_for(rt).limits
    inst = rt.queue._inline_instance
    if inst is None:
        raise RuntimeError("tiny does not run inline in this daemon: the fused path would not compare")

    async def app_call() -> None:
        sent.clear()
        await app(dict(scope), receive, send)
        if sent[0]["status"] != 200:
            raise RuntimeError(f"the app answered {sent}")

    async def fused_call() -> None:
        m = await receive()
        req = decode_infer(m["body"], len(header), None, limits)
        answer, header_len = _encode_small("tiny", req, inst._infer_impl(req.inputs), None)
        head = [(b"content-type", b"application/octet-stream"), (b"content-length", str(len(answer)).encode())]
        head.append((b"inference-header-content-length", str(header_len).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": head})
        await send({"type": "http.response.body", "body": answer})

    return app_call, fused_call


async def _lines(call: Call, where: dict[str, int] | None = None) -> float:
    """Python lines run by one call (every function it calls included); ``where``: filled with
    the count per function (file:function)."""
    count = 0
    where = {} if where is None else where

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
            code = frame.f_code
            key = f"{'/'.join(code.co_filename.rsplit('/', 2)[-2:])}:{code.co_name}"
            where[key] = where.get(key, 0) + 1
        return tracer

    sys.settrace(tracer)
    try:
        await call()
    finally:
        sys.settrace(None)
    return float(count)


if __name__ == "__main__":
    main()
