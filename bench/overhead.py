"""Where a request's time goes outside the model: edged against a second daemon of the same code
(the A/A spread), the hand-written FastAPI server, a bare echo and the bounds of this machine and
of the protocol (the limit lanes), all as ratios to the in-process floor measured in the same run.

Daemons serving the same model, interleaved with the in-process floor, at concurrency 1 and 4
(``--lanes`` picks them; default ``edged,inline,worker``):
  * ``edged``: this tree, as configured by default (whether the model runs on the event loop is
    the warm-up's decision; the daemon's choice is printed at the end);
  * ``edged-inline``: ``[server] inline_threshold_us`` high enough that the model runs on the
    event loop: no hand-off to a worker thread and back;
  * ``edged-worker``: ``inline_threshold_us = 0``: every request goes to the model's worker
    thread (two thread hops per request);
  * ``edged-twin``: the edged lane's daemon again, the same code and configuration: the spread
    of two daemons that should measure the same (an A/A check for every other comparison);
  * ``edged-auto``: the model's intra-op threads left to the daemon (``threads = 0``; the other
    lanes and the peers run the spec's count, one thread for tiny): the rule's count, cores divided
    by instances, or fewer where the warm-up measures the model as fast with fewer;
  * ``fastapi``: the hand-written FastAPI/uvicorn server of the peer benchmark (bench/peer_fastapi.py),
    the figure the throughput target is a ratio to;
  * ``echo``: a bare ASGI app on the same uvicorn stack (uvloop, httptools, a Unix socket) that
    reads the request and answers a fixed 100-byte body: the transport's own cost, the limit under
    edged's figure (not checked against the model's answer; it runs no model);
  * ``limit``: the echo's stack running the model on its event loop on an input it holds
    (bench/limit.py): what any server on this stack can do for the model, the bound a target is
    judged against; ``limitworker``: the same with the run on a worker thread, the loop free
    meanwhile (what a server that may not block its loop for a run can do); ``limitv2``: the
    least an Open Inference Protocol server does (edged's decoder and encoder around the run on
    the loop, nothing else), the bound the protocol itself sets;
  * ``edged-base`` (with ``--base COMMIT``): edged's package as of that commit (``git archive``
    into the work folder, first on the daemon's PYTHONPATH), configured as the first edged lane
    is: a before/after of a change to edged's code in one interleaved run.

For a frame model with the ``posix`` lane, the in-process floor is also measured with the copies a
POSIX object costs (``in-process+copies``), on a session whose pool parks after each run as a
daemon's does (``pool parked``), and with that parked floor's copies and run handed to a worker
thread each request (``on a worker``: the two wake-ups of a server that keeps its loop free).

For a frame model, the first edged lane is also measured with the frame already in its sealed
memfd region (``frame in place``: the producer writes it there, no copy inside the timing), and
with the answer written into the same region too (``answer in place``: only JSON headers cross
the socket; the answer is checked against ONNX Runtime's once per connection, untimed).

    scripts/bench.sh overhead [--model tiny|conv640|ocr_det] [--rounds 8] [--restarts 4] [--lanes edged,twin,worker]
                              [--base HEAD~1|FOLDER] [--form binary|numbered|json]
                              [--stages]   (the edged lane's daemon times its stages, or the posix lane's
                                            without it: medians per lane)
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.base_tree import BaseEdged
from bench.edged_server import EdgedServer, get_status
from bench.first_request import StagedEdged
from bench.limit_servers import EchoServer, LimitPosixServer, LimitServer, LimitV2Server, LimitWorkerServer
from bench.measure import (
    FLOOR,
    FLOOR_COPIES,
    FLOOR_PARKED,
    FLOOR_WORKER,
    Budget,
    Lane,
    Runner,
    Series,
    copies_floor_runner,
    floor_runner,
    interleave,
    merge,
    rounds_per_start,
    server_runner,
)
from bench.models import ModelSpec, prepare, session, write_specs
from bench.overhead_report import lane_stages, report
from bench.peer_servers import FastAPIServer
from bench.servers import Server, check
from bench.wire import FORMS, closed_loop, connect, roundtrip
from edged.backends.onnxruntime import SERVING_CONFIG

REPO = Path(__file__).resolve().parent.parent
LANES = (
    *("edged", "posix", "posix-spin", "posix-t1", "twin", "inline", "worker", "auto"),
    *("fastapi", "echo", "limit", "limitworker", "limitv2", "limitposix"),
)


def _no_copy(server: EdgedServer, spec: ModelSpec, x: np.ndarray, conc: int) -> Runner:
    conns = [server.frame_conn(spec, x, i) for i in range(conc)]
    for conn in conns:
        conn.before = None  # the region already holds the frame

    def run(max_requests: int, max_seconds: float) -> tuple[list[float], float]:
        return closed_loop(conns, max_requests, max_seconds)

    return run


def servers_for(
    work: Path,
    spec: ModelSpec,
    lanes: list[str],
    base: str | None,
    beside: dict[str, ModelSpec] | None = None,
    stages: Path | None = None,
) -> list[Server]:
    one = {spec.name: spec, **(beside or {})}
    make: dict[str, Callable[[], Server]] = {
        "edged": lambda: EdgedServer(work, one, label="edged") if stages is None else StagedEdged(work, one, stages),
        # Frames through a POSIX object (copied with preadv/pwrite, as Triton's clients register).
        # Timed instead of the edged lane when that lane is not run (a file of stages per run).
        "posix": lambda: (
            EdgedServer(work, one, label="edged-posix", shm="posix")
            if stages is None or "edged" in lanes
            else StagedEdged(work, one, stages, shm="posix", label="edged-posix")
        ),
        # The same with ONNX Runtime's pool left spinning after each run (its default), and with
        # one intra-op thread (no pool to wake): the two other ways around a parked pool's wake-up.
        "posix-spin": lambda: StagedEdged(work, one, None, shm="posix", spinning=True, label="edged-posix-spin"),
        "posix-t1": lambda: EdgedServer(
            work, one, {m: {"threads": 1} for m in one}, label="edged-posix-t1", shm="posix"
        ),
        "inline": lambda: EdgedServer(work, one, label="edged-inline", server={"inline_threshold_us": 10_000_000}),
        "worker": lambda: EdgedServer(work, one, label="edged-worker", server={"inline_threshold_us": 0}),
        # The models' intra-op threads left to the daemon (threads = 0): the rule's count, or
        # fewer where its warm-up measures them as fast (edged/serving/threadpick.py).
        "auto": lambda: EdgedServer(work, one, {m: {"threads": 0} for m in one}, label="edged-auto"),
        # The edged lane's daemon a second time: what two daemons of the same code differ by.
        "twin": lambda: EdgedServer(work, one, label="edged-twin"),
        "fastapi": lambda: FastAPIServer(work, one),
        "echo": lambda: EchoServer(work, one),
        "limit": lambda: LimitServer(work, {spec.name: spec}),
        "limitworker": lambda: LimitWorkerServer(work, {spec.name: spec}),
        "limitv2": lambda: LimitV2Server(work, {spec.name: spec}),
        "limitposix": lambda: LimitPosixServer(work, {spec.name: spec}),
    }
    servers = [make[name]() for name in lanes]
    if base is not None:
        # Configured as the first edged lane is (edged-worker's base runs on its worker too,
        # edged-auto's leaves the threads to the daemon too).
        like = next((s for s in servers if isinstance(s, EdgedServer)), None)
        based = BaseEdged(work, one, base, like.server_options, like.options) if like else BaseEdged(work, one, base)
        based.shm = like.shm if like else based.shm  # its frames through the same kind of region
        servers.append(based)
    return servers


def _placement(server: Server, model: str) -> str:
    """Where the daemon runs the model, as its status says (inline: on the event loop)."""
    if not isinstance(server, EdgedServer):
        return f"{server.name:16} (not edged)"
    doc: dict[str, Any] = get_status(server.addr)["models"][model]
    return f"{server.name:16} inline={doc.get('inline')} infer_us={doc.get('infer_us')} threads={doc.get('threads')}"


def starts(
    work: Path, spec: ModelSpec, lanes: list[str], base: str | None, n: int, beside: dict[str, ModelSpec]
) -> None:
    """Each daemon started ``n`` times, alternated: its inline decision, measured run cost and
    intra-op threads, and its time from spawn to READY=1 (``beside``: other models the daemons
    serve too, warmed in the same start)."""
    try:
        servers = [s for s in servers_for(work, spec, lanes, base, beside) if isinstance(s, EdgedServer)]
        seen: dict[str, list[str]] = {s.name: [] for s in servers}
        ready: dict[str, list[float]] = {s.name: [] for s in servers}
        for _ in range(n):
            for s in servers:
                s.start()
                try:
                    ready[s.name].append(s.wait_ready())
                    doc = get_status(s.addr)["models"][spec.name]
                    where = "inline" if doc.get("inline") else "worker"
                    seen[s.name].append(f"{where}/{doc.get('infer_us')}/{doc.get('threads', '-')}")
                finally:
                    s.stop()
        for name, decisions in seen.items():
            inline = sum(d.startswith("inline") for d in decisions)
            took = ready[name]
            print(
                f"{spec.name} {name:16} inline in {inline}/{n} starts (where/us/threads): {', '.join(decisions)}; "
                f"ready after {statistics.median(took):.3f} s median ({min(took):.3f}-{max(took):.3f})",
                flush=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _in_place(server: EdgedServer, spec: ModelSpec, x: np.ndarray, want: np.ndarray, conc: int) -> Runner:
    """The frame already in the region and the answer written there too: the socket carries two
    JSON headers. Each connection's answer is checked against ONNX Runtime's once, untimed."""
    conns = []
    for _ in range(conc):
        conn, answer = server.in_place_conn(spec, x, want)
        with connect(conn.addr) as s:
            roundtrip(s, conn.request)
        if not np.allclose(answer(), want, rtol=1e-4, atol=1e-5):
            raise AssertionError(f"{server.name}/{spec.name}: wrong answer in the region")
        conns.append(conn)

    def run(max_requests: int, max_seconds: float) -> tuple[list[float], float]:
        return closed_loop(conns, max_requests, max_seconds)

    return run


def main(argv: list[str] | None = None) -> None:
    ap = _parser()
    args = ap.parse_args(argv)
    EdgedServer.request_form = args.form
    lanes = [n for n in args.lanes.split(",") if n]
    unknown = set(lanes) - set(LANES)
    if unknown:
        ap.error(f"unknown lanes {sorted(unknown)}; pick from {', '.join(LANES)}")
    if args.stages and "twin" in lanes:
        ap.error("--stages times the edged lane's daemon only: its twin would not be the same daemon")
    specs = prepare(REPO / "data", REPO / "data" / "bench")
    spec = specs[args.model]
    work = Path(tempfile.mkdtemp(prefix="edged-overhead-"))
    if args.starts:
        beside = {m: specs[m] for m in args.beside.split(",") if m and m != spec.name}
        starts(work, spec, lanes, args.base, args.starts, beside)
        return
    stages = work / "stages.jsonl" if args.stages else None
    results, placements, by_lane = _measure(args, spec, specs, lanes, work, stages)
    restarts = len(rounds_per_start(args.rounds, args.restarts))
    report(spec, results, placements, args.out, by_lane, {"rounds": args.rounds, "restarts": restarts})


def _parser() -> argparse.ArgumentParser:
    """The command line; ``main`` checks the lanes it names."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--lanes", default="edged,inline,worker", help=f"comma-separated, of {', '.join(LANES)}")
    ap.add_argument(
        "--base",
        default=None,
        help="a commit or a folder holding edged/: add a daemon running that edged, configured as the first edged lane",
    )
    ap.add_argument("--concurrency", default="1,4", help="comma-separated")
    ap.add_argument(
        "--starts",
        type=int,
        default=0,
        help="only start each daemon this many times, alternated, "
        "and print where it runs the model (the warm-up's inline decision)",
    )
    ap.add_argument(
        "--restarts",
        type=int,
        default=1,
        help="start every daemon this many times, the rounds shared among the starts (placement sampled, not fixed)",
    )
    ap.add_argument("--beside", default="", help="with --starts: other models the daemons serve too")
    ap.add_argument("--out", type=Path, default=None, help="default: bench-results/overhead_MODEL.json")
    ap.add_argument(
        "--stages",
        action="store_true",
        help="the edged lane's daemon (the posix lane's without it) with stage timers (bench.stages): "
        "per lane, the median of each stage",
    )
    ap.add_argument(
        "--form",
        choices=FORMS,
        default="binary",
        help="how the edged lanes' clients write a request in the body: binary tensors, the same with "
        "a request id (numbered), or the values in JSON",
    )
    return ap


def _measure(
    args: argparse.Namespace,
    spec: ModelSpec,
    specs: dict[str, ModelSpec],
    lanes: list[str],
    work: Path,
    stages: Path | None,
) -> tuple[dict[str, dict[int, Series]], list[str], dict[str, dict[str, float]] | None]:
    """Every lane interleaved with the floor; with ``stages``, the edged lane's daemon times its
    stages, and each request's record is given to the lane whose burst it fell in. With
    ``--restarts K`` every daemon is started K times, the rounds shared among the starts: where a
    start's threads land stays fixed for that start, and two starts of the same code differed by
    up to 29% at c=4 on the 16-core host (the ``twin`` lane)."""
    concs = [int(c) for c in args.concurrency.split(",")]
    budget = Budget(3000, 0.3) if not spec.frame else Budget(300, 0.5)
    servers: list[Server] = []
    windows: list[tuple[str, float, float]] = []
    by_lane = None
    results: dict[str, dict[int, Series]] = {}
    placements: list[str] = []
    try:
        servers = servers_for(work, spec, lanes, args.base, stages=stages)
        write_specs(work / "specs.json", specs)
        for k, rounds in enumerate(rounds_per_start(args.rounds, args.restarts)):
            for s in servers:
                s.stop()  # a no-op before the first start
                s.start()
                s.wait_ready()
            merge(results, _segment(servers, spec, concs, budget, windows, rounds))
            placements += [f"start {k + 1}: {_placement(s, spec.name)}" for s in servers]
    finally:
        for s in servers:
            s.close_frames()
            s.stop()  # the stage records are written as the daemon exits
        if stages is not None and stages.exists():
            by_lane = lane_stages(stages, windows, spec.name)
        shutil.rmtree(work, ignore_errors=True)
    return results, placements, by_lane


def _segment(
    servers: list[Server],
    spec: ModelSpec,
    concs: list[int],
    budget: Budget,
    windows: list[tuple[str, float, float]],
    rounds: int,
) -> dict[str, dict[int, Series]]:
    """``rounds`` interleaved rounds against the servers as started now (answers checked first)."""
    x = spec.sample()
    sess = session(spec)
    want = sess.run([spec.outputs[0]], {spec.input: x})[0]
    runs = {(FLOOR, c): Lane(floor_runner(sess, spec, x, c), budget) for c in concs}
    if spec.frame and 1 in concs:
        runs[(FLOOR_COPIES, 1)] = Lane(copies_floor_runner(sess, spec, x), budget)
        parked = session(spec, SERVING_CONFIG)
        runs[(FLOOR_PARKED, 1)] = Lane(copies_floor_runner(parked, spec, x), budget)
        runs[(FLOOR_WORKER, 1)] = Lane(copies_floor_runner(parked, spec, x, worker=True), budget)
    for s in servers:
        if s.answers:  # the echo and the limit lanes answer nothing the model computed
            check(s, spec, x, want)
        for c in concs:
            runs[(s.name, c)] = Lane(server_runner(s, spec, x, c), budget)
    # The producer writes its frame in the region in place (no copy), for every edged daemon (a
    # twin or a base beside edged: a change to the frame path compared side by side).
    for s in servers if spec.frame else []:
        if not isinstance(s, EdgedServer):
            continue
        for c in concs:
            runs[(f"{s.name}, frame in place", c)] = Lane(_no_copy(s, spec, x, c), budget)
            runs[(f"{s.name}, answer in place", c)] = Lane(_in_place(s, spec, x, want, c), budget)
    timed = {key: Lane(_windowed(f"{key[0]} c={key[1]}", lane.run, windows), lane.budget) for key, lane in runs.items()}
    try:
        return interleave(timed, rounds)
    finally:
        for s in servers:
            s.close_frames()


def _windowed(name: str, run: Runner, windows: list[tuple[str, float, float]]) -> Runner:
    def timed(max_requests: int, max_seconds: float) -> tuple[list[float], float]:
        t0 = time.time()
        try:
            return run(max_requests, max_seconds)
        finally:
            windows.append((name, t0, time.time()))

    return timed


if __name__ == "__main__":
    main()
