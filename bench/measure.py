"""The measurements: serving (latency and throughput per concurrency, interleaved across every
server and the in-process floor), cold start (start → ready, first request, memory), and edged's
scheduler (dynamic batching and instances against no batching).

Every request loop is bounded in count and in time.
"""

from __future__ import annotations

import mmap
import os
import re
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import numpy as np

from bench.edged_server import EdgedServer, get_status
from bench.models import ModelSpec, session
from bench.servers import Server, check, placement
from bench.wire import Conn, closed_loop, connect, roundtrip

Runner = Callable[[int, float], tuple[list[float], float]]
FLOOR = "in-process"
# The floor of a frame through a POSIX object: the producer's copy into it, the kernel's copy out
# of it (preadv into the buffer the run reads), the run, and the answer's copy out (pwrite into
# the object), all in this process: what a server that copies as edged does cannot beat.
FLOOR_COPIES = "in-process+copies"
# The same, on a session with edged's serving options (its pool parked after every run, as a
# daemon's is): the floor of a server that may not leave a pool spinning between requests.
FLOOR_PARKED = "in-process+copies, pool parked"
# The parked floor with its copy in, run and copy out on a worker thread the caller hands each
# request to and waits for (two thread wake-ups, as run_in_executor's): the floor of a server that
# keeps its event loop free during a frame's run, as edged must.
FLOOR_WORKER = "in-process+copies, on a worker"


@dataclass(frozen=True)
class Budget:
    """One burst: at most this many requests, at most this long (then in-flight ones finish)."""

    requests: int
    seconds: float


def floor_runner(sess: Any, spec: ModelSpec, x: np.ndarray, conc: int) -> Runner:
    """ONNX Runtime in this process: one loop, or ``conc`` threads on the same session."""
    feed, outs = {spec.input: x}, [spec.outputs[0]]

    def loop(n: int, until: float, out: list[float]) -> None:
        for _ in range(n):
            t0 = time.perf_counter()
            sess.run(outs, feed)
            out.append(time.perf_counter() - t0)
            if t0 > until:
                return

    def run(max_requests: int, max_seconds: float) -> tuple[list[float], float]:
        t0 = time.perf_counter()
        until = t0 + max_seconds
        per = [[] for _ in range(conc)]  # type: list[list[float]]
        if conc == 1:
            loop(max_requests, until, per[0])
        else:
            threads = [threading.Thread(target=loop, args=(max(1, max_requests // conc), until, p)) for p in per]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        return [v for p in per for v in p], time.perf_counter() - t0

    return run


def copies_floor_runner(sess: Any, spec: ModelSpec, x: np.ndarray, worker: bool = False) -> Runner:
    """``floor_runner`` at c=1 with the copies a frame through a POSIX object costs (FLOOR_COPIES);
    ``worker``: the server's part handed to a thread of its own each request (FLOOR_WORKER)."""
    src = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
    outs = [spec.outputs[0]]
    answer_bytes = np.asarray(sess.run(outs, {spec.input: x})[0]).nbytes
    path = f"/dev/shm/edged-bench-floor-{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    os.unlink(path)  # the descriptor and the mapping keep it alive, nothing is left behind
    os.ftruncate(fd, src.nbytes + answer_bytes)
    view = np.frombuffer(mmap.mmap(fd, src.nbytes + answer_bytes), np.uint8)
    buf = np.empty(src.nbytes, np.uint8)
    tensor = buf.view(x.dtype).reshape(x.shape)

    def serve() -> None:
        os.preadv(fd, [buf], 0)  # the server's copy in
        out = sess.run(outs, {spec.input: tensor})[0]
        os.pwrite(fd, np.ascontiguousarray(out).data, src.nbytes)  # the answer's copy out

    def run(max_requests: int, max_seconds: float) -> tuple[list[float], float]:
        pool = ThreadPoolExecutor(1) if worker else None
        t0 = time.perf_counter()
        until = t0 + max_seconds
        times: list[float] = []
        try:
            for _ in range(max_requests):
                t = time.perf_counter()
                np.copyto(view[: src.nbytes], src)  # the producer
                if pool is None:
                    serve()
                else:
                    pool.submit(serve).result()
                times.append(time.perf_counter() - t)
                if t > until:
                    break
        finally:
            if pool is not None:
                pool.shutdown()
        return times, time.perf_counter() - t0

    return run


def server_runner(server: Server, spec: ModelSpec, x: np.ndarray, conc: int) -> Runner:
    """``conc`` keep-alive connections, each with one request in flight."""
    if spec.frame:
        conns = [server.frame_conn(spec, x, i) for i in range(conc)]
    else:
        req = server.request(spec, x)
        conns = [Conn(server.addr, req) for _ in range(conc)]

    def run(max_requests: int, max_seconds: float) -> tuple[list[float], float]:
        return closed_loop(conns, max_requests, max_seconds)

    return run


@dataclass
class Series:
    """What one (target, model, concurrency) collected over the rounds."""

    latencies: list[float] = field(default_factory=list)
    throughput: list[float] = field(default_factory=list)

    def add(self, lat: list[float], wall: float) -> None:
        self.latencies += lat
        self.throughput.append(len(lat) / wall if wall > 0 else 0.0)

    def summary(self) -> dict[str, Any]:
        ms = np.asarray(self.latencies) * 1000
        q = np.percentile(ms, np.arange(101)) if ms.size else np.zeros(101)
        return {
            "n": int(ms.size),
            "p50_ms": float(q[50]),
            "p90_ms": float(q[90]),
            "p99_ms": float(q[99]),
            "mean_ms": float(ms.mean()) if ms.size else 0.0,
            "throughput_rps": statistics.median(self.throughput) if self.throughput else 0.0,
            "throughput_rounds": self.throughput,
            "quantiles_ms": [float(v) for v in q],
        }


def serving(
    servers: Sequence[Server],
    specs: dict[str, ModelSpec],
    concurrencies: Sequence[int],
    rounds: int,
    budgets: dict[str, Budget],
) -> dict[str, dict[str, dict[int, Series]]]:
    """For each model, every target at every concurrency, round-robin (the order rotates each
    round), so that all of them see the same noise. Answers are checked before timing."""
    out: dict[str, dict[str, dict[int, Series]]] = {}
    for spec in specs.values():
        x = spec.sample()
        sess = session(spec)
        want = sess.run([spec.outputs[0]], {spec.input: x})[0]
        lanes: dict[tuple[str, int], Lane] = {}
        for s in servers:
            if s.answers:
                check(s, spec, x, want)
        try:
            for c in concurrencies:
                lanes[(FLOOR, c)] = Lane(floor_runner(sess, spec, x, c), budgets[spec.name])
                for s in servers:
                    lanes[(s.name, c)] = Lane(server_runner(s, spec, x, c), budgets[spec.name])
            out[spec.name] = interleave(lanes, rounds)
        finally:
            for s in servers:
                s.close_frames()
    return out


def rounds_per_start(rounds: int, starts: int) -> list[int]:
    """``rounds`` shared among ``starts`` starts of every server, earlier starts taking the
    remainder; never a start without a round (``starts`` is capped at ``rounds``)."""
    n = max(1, min(starts, rounds))
    return [rounds // n + (1 if k < rounds % n else 0) for k in range(n)]


def merge(into: dict[str, dict[int, Series]], more: dict[str, dict[int, Series]]) -> None:
    """``more``'s series (per target, per concurrency) added to ``into``'s: rounds run against
    another start of the same servers."""
    for name, by_c in more.items():
        for c, series in by_c.items():
            mine = into.setdefault(name, {}).setdefault(c, Series())
            mine.latencies += series.latencies
            mine.throughput += series.throughput


@dataclass(frozen=True)
class Lane:
    run: Runner
    budget: Budget


def interleave(lanes: dict[tuple[str, int], Lane], rounds: int) -> dict[str, dict[int, Series]]:
    out: dict[str, dict[int, Series]] = {}
    keys = list(lanes)
    for key in keys:  # warm every lane once, unrecorded
        b = lanes[key].budget
        lanes[key].run(max(1, b.requests // 10), b.seconds / 4)
    for r in range(rounds):
        shift = r % len(keys)
        for key in keys[shift:] + keys[:shift]:
            lane = lanes[key]
            lat, wall = lane.run(lane.budget.requests, lane.budget.seconds)
            out.setdefault(key[0], {}).setdefault(key[1], Series()).add(lat, wall)
    return out


# --- cold start ---------------------------------------------------------------------------------

STEADY = {"tiny": 300, "conv640": 30, "ocr_det": 5}


def one_request(conn: Conn) -> float:
    """One request on a fresh connection, as a client that just started would send it (a frame is
    copied into its region first, inside the timing)."""
    t0 = time.perf_counter()
    if conn.before is not None:
        conn.before()
    with connect(conn.addr) as s:
        roundtrip(s, conn.request)
    return time.perf_counter() - t0


def _steady(conn: Conn, n: int) -> float:
    with connect(conn.addr) as s:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            if conn.before is not None:
                conn.before()
            roundtrip(s, conn.request)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _client_conns(server: Server, specs: dict[str, ModelSpec]) -> tuple[dict[str, Conn], float]:
    """Each model's connection as a client sets it up on its start: frames through a registered
    shared memory region where the server offers one. Returns the set-up time too."""
    t0 = time.perf_counter()
    conns = {
        m: server.frame_conn(s, s.sample(), 0) if s.frame else Conn(server.addr, server.request(s, s.sample()))
        for m, s in specs.items()
    }
    return conns, time.perf_counter() - t0


AFTER_GAPS = 5  # requests after the idle gap per model and start: their median is the reference


def cold_start(server: Server, specs: dict[str, ModelSpec], gap: float, touch: bool = False) -> dict[str, Any]:
    """Spawn → ready; then per model, after an idle gap, the first request; steady requests; then
    AFTER_GAPS times the same gap and one more request (what a warm server answers after that gap;
    their median, since one request after a gap is one sample of the machine's wake-up noise).
    ``touch`` sends one GET through the socket right after ready (an experiment, off in the
    benchmark)."""
    wall0 = time.time()
    server.start()
    ready_s = server.wait_ready()
    if touch:
        with connect(server.addr) as s:
            s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: localhost\r\n\r\n")
            s.recv(4096)
    conns, setup_s = _client_conns(server, specs)
    events: list[tuple[str, float, float]] = [("ready", 0.0, ready_s)]
    first: dict[str, float] = {}
    steady: dict[str, float] = {}
    after_all: dict[str, list[float]] = {m: [] for m in conns}
    for m, conn in conns.items():
        time.sleep(gap)  # the idle gap being measured, not synchronisation
        at = time.perf_counter() - server.spawned
        first[m] = one_request(conn)
        events.append((f"first {m}", at, first[m]))
    for m, conn in conns.items():
        steady[m] = _steady(conn, STEADY[m])
    for _ in range(AFTER_GAPS):
        for m, conn in conns.items():
            time.sleep(gap)  # the same idle gap on a server that has served
            after_all[m].append(one_request(conn))
    after = {m: statistics.median(v) for m, v in after_all.items()}
    result: dict[str, Any] = {
        "ready_s": ready_s,
        "client_setup_ms": setup_s * 1000,
        "first_ms": _ms(first),
        "steady_ms": _ms(steady),
        "after_gap_ms": _ms(after),
        "after_gaps_ms": {m: [v * 1000 for v in vs] for m, vs in after_all.items()},
        "memory": server.memory(),
        "placement": placement(server.pid),
        "events": events,
    }
    if isinstance(server, EdgedServer):
        result["phases"] = edged_phases(server.log_tail(200_000), wall0)
        result["warmup_s"] = warmup_seconds(result["phases"])
    server.close_frames()
    server.stop()
    result["leftover_pids"] = server.stopped_leftovers
    result["leaked_shm"] = server.leaked_shm
    return result


def _ms(d: dict[str, float]) -> dict[str, float]:
    return {k: v * 1000 for k, v in d.items()}


_PHASE = re.compile(
    r"^(\S+ \S+) INFO edged\.(?:registry|daemon): (?:(\S+): (loading|warming|ready)\b|(ready):)", re.MULTILINE
)


def edged_phases(log: str, wall0: float) -> list[tuple[str, str, float]]:
    """(model, phase, seconds since spawn) from the daemon's log of its last start."""
    starts = [m.start() for m in re.finditer(r"^.*memory from ", log, re.MULTILINE)]
    log = log[starts[-1] :] if starts else log
    out = []
    for m in _PHASE.finditer(log):
        at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - wall0
        out.append((m.group(2) or "daemon", m.group(3) or "ready", at))
    return out


def warmup_seconds(phases: list[tuple[str, str, float]]) -> float:
    """Time spent warming: each model's warming → ready, plus the request-path warm-up between
    the last model ready and the daemon ready."""
    total, warming, last_ready = 0.0, {}, 0.0
    for model, phase, at in phases:
        if phase == "warming":
            warming[model] = at
        elif phase == "ready" and model in warming:
            total += at - warming.pop(model)
            last_ready = max(last_ready, at)
        elif phase == "ready" and model == "daemon" and last_ready:
            total += at - last_ready
    return total


# --- the scheduler: batching and instances --------------------------------------------------------


def scheduler(server: EdgedServer, cases: Sequence[tuple[str, int, Budget]], rounds: int) -> dict[str, Any]:
    """Each case is a model as the daemon serves it (its own name, its own batching and
    instances) at a concurrency; all interleaved. Answers are checked first."""
    lanes: dict[tuple[str, int], Lane] = {}
    try:
        for name, conc, budget in cases:
            spec = server.specs[name]
            x = spec.sample()
            check(server, spec, x, session(spec).run([spec.outputs[0]], {spec.input: x})[0])
            lanes[(name, conc)] = Lane(server_runner(server, spec, x, conc), budget)
        series = interleave(lanes, rounds)
    finally:
        server.close_frames()
    status = get_status(server.addr)
    return {"series": series, "status": {m: status["models"][m] for m in server.specs}}
