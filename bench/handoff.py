"""Probe: what handing a model run from an event loop to a worker thread and back costs, and what
ONNX Runtime's spinning does to a run that follows an idle gap.

One server process (uvloop) and one client process exchange 1-byte requests over a Unix socket;
the model input is held by the server, so nothing but the hand-offs and the run is measured.
Modes, alternated in rounds with the in-process floor:
  * ``floor``: runs back to back in this process (what the peer benchmark's floor does);
  * ``floor after gap``: the same, 0.5 ms idle before each run (what a request/response client
    leaves between two runs);
  * ``echo``: the socket alone, no model;
  * ``on the loop``: the model run on the event loop (the limit of a server that does nothing else);
  * ``worker``: edged's path: a deque and a Condition to wake the model's worker thread, the
    answer handed back with ``call_soon_threadsafe`` (the server measures the wake-up of the worker,
    the run on it and the wake-up of the loop);
  * ``worker, answered there``: the worker writes the 1-byte answer to the socket itself, then
    tells the loop: what a path without the loop's wake-up would save.

Sessions are built as edged builds them (``--session stop``: its pool stops spinning when a run
returns), with spinning left on (``spin``, ONNX Runtime's default) or off (``nospin``); the
process's CPU time per request is reported too, since spinning buys latency with cores.

    scripts/bench.sh handoff [--model conv640] [--threads 0] [--session stop,spin] [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.models import ModelSpec, prepare, session
from bench.peers import machine

REPO = Path(__file__).resolve().parent.parent
GAP_S = 0.0005
CLIENT = r"""
import socket, sys, time
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); n = int(sys.argv[2])
out = []
for i in range(n + 50):
    t = time.perf_counter_ns(); s.send(b"q"); s.recv(1); d = time.perf_counter_ns() - t
    if i >= 50:
        out.append(d)
    time.sleep(0.0003)
print(" ".join(map(str, out)))
"""


# Each --session choice as session config entries (stop: edged's serving sessions).
SESSIONS = {
    "stop": {"session.force_spinning_stop": "1"},
    "spin": {},
    "nospin": {"session.intra_op.allow_spinning": "0"},
}


def make_session(spec: ModelSpec, threads: int, mode: str) -> Callable[[], Any]:
    sess = session(spec, threads, SESSIONS[mode])
    feed, outs = {spec.input: spec.sample()}, [spec.outputs[0]]
    for _ in range(30):
        sess.run(outs, feed)
    return lambda: sess.run(outs, feed)


class Worker:
    """edged's hand-off in miniature (scheduler.ModelQueue): deque + Condition in,
    call_soon_threadsafe out; ``direct``: the answer written from this thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, infer: Callable[[], Any], direct: bool) -> None:
        self.loop, self.infer, self.direct = loop, infer, direct
        self.jobs: collections.deque[tuple[int, Callable[[], None], int]] = collections.deque()
        self.cond = threading.Condition()
        self.stages: list[tuple[int, int, int]] = []  # wake-up of the worker, run, (loop's wake-up)
        self._ran = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def submit(self, fd: int, reply: Callable[[], None]) -> None:
        with self.cond:
            self.jobs.append((fd, reply, time.perf_counter_ns()))
            self.cond.notify()

    def _serve(self) -> None:
        while True:
            with self.cond:
                while not self.jobs:
                    self.cond.wait()
                fd, reply, submitted = self.jobs.popleft()
            t0 = time.perf_counter_ns()
            self.infer()
            self._ran = time.perf_counter_ns()
            self.stages.append((t0 - submitted, self._ran - t0, 0))
            if self.direct:
                os.write(fd, b"r")
                self.loop.call_soon_threadsafe(lambda: None)
            else:
                self.loop.call_soon_threadsafe(reply)

    def answered(self) -> None:
        """On the loop, for the worker's last run: how long the loop took to wake."""
        wake, run, _ = self.stages[-1]
        self.stages[-1] = (wake, run, time.perf_counter_ns() - self._ran)


class Handler(asyncio.Protocol):
    def __init__(self, mode: str, infer: Callable[[], Any], worker: Worker | None) -> None:
        self.mode, self.infer, self.worker = mode, infer, worker
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        transport, worker = self.transport, self.worker
        assert transport is not None
        if self.mode == "on the loop":
            self.infer()
        if worker is None:
            transport.write(b"r")
            return

        def reply() -> None:
            worker.answered()
            transport.write(b"r")

        worker.submit(transport.get_extra_info("socket").fileno(), reply)


async def _client(sock: str, n: int) -> list[float]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", CLIENT, sock, str(n), stdout=subprocess.PIPE)
    out, _ = await proc.communicate()
    return [int(v) / 1e6 for v in out.split()]


def _floor(infer: Callable[[], Any], n: int, gap: float) -> list[float]:
    out = []
    for _ in range(n):
        if gap:
            time.sleep(gap)
        t0 = time.perf_counter_ns()
        infer()
        out.append((time.perf_counter_ns() - t0) / 1e6)
    return out


async def measure(infer: Callable[[], Any], rounds: int, n: int, work: Path) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    workers = {"worker": Worker(loop, infer, False), "worker, answered there": Worker(loop, infer, True)}
    modes = ["echo", "on the loop", *workers]
    lat: dict[str, list[float]] = {m: [] for m in ["floor", "floor after gap", *modes]}
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    sock = str(work / "handoff.sock")
    for _ in range(rounds):
        lat["floor"] += _floor(infer, n, 0)
        lat["floor after gap"] += _floor(infer, n, GAP_S)
        for m in modes:
            Path(sock).unlink(missing_ok=True)
            server = await loop.create_unix_server(lambda m=m: Handler(m, infer, workers.get(m)), sock)  # type: ignore[misc]
            cpu0 = time.process_time()
            got = await _client(sock, n)
            cpu[m].append((time.process_time() - cpu0) / len(got) * 1e3)
            lat[m] += got
            server.close()
    floor = statistics.median(lat["floor"])
    out: dict[str, Any] = {}
    for m, values in lat.items():
        arr = np.array(values)
        d = {
            "p50_ms": float(np.median(arr)),
            "p90_ms": float(np.percentile(arr, 90)),
            "p99_ms": float(np.percentile(arr, 99)),
        }
        d["p50_over_floor"] = d["p50_ms"] / floor
        if m in cpu:
            d["server_cpu_ms_per_request"] = statistics.median(cpu[m])
        if m in workers:
            st = workers[m].stages
            d["worker_wake_ms"] = statistics.median(s[0] for s in st) / 1e6
            d["run_ms"] = statistics.median(s[1] for s in st) / 1e6
            if m == "worker":
                d["loop_wake_ms"] = statistics.median(s[2] for s in st if s[2]) / 1e6
        out[m] = d
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="conv640")
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: the benchmark's choice)")
    ap.add_argument("--session", default="stop,spin", help="comma-separated, of stop, spin, nospin")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=300, help="per mode and round")
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "handoff.json")
    args = ap.parse_args(argv)
    spec = prepare(REPO / "data", REPO / "data" / "bench")[args.model]
    threads = args.threads or spec.threads
    results: dict[str, Any] = {"model": spec.name, "threads": threads, "machine": machine(), "sessions": {}}
    with tempfile.TemporaryDirectory(prefix="edged-handoff-") as tmp:
        for mode in args.session.split(","):
            infer = make_session(spec, threads, mode)
            res = asyncio.run(measure(infer, args.rounds, args.requests, Path(tmp)))
            results["sessions"][mode] = res
            for m, d in res.items():
                extra = "".join(
                    f"  {k.removesuffix('_ms')} {v:.3f}"
                    for k, v in d.items()
                    if k.endswith("_ms") and not k.startswith("p")
                )
                cpu = d.get("server_cpu_ms_per_request")
                head = f"{spec.name} x{threads} {mode:6} {m:23}"
                print(
                    f"{head} p50 {d['p50_ms']:.3f} ms ({d['p50_over_floor']:.2f}x floor)"
                    f"  p90 {d['p90_ms']:.3f}  p99 {d['p99_ms']:.3f}{extra}"
                    + (f"  cpu {cpu:.2f} ms/request" if cpu is not None else ""),
                    flush=True,
                )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"written to {args.out}", flush=True)


if __name__ == "__main__":
    main()
