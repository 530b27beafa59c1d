"""The first request after READY=1 against a request after the same idle gap on a daemon that
has served, over fresh starts, per model (tiny over the socket, conv640 and the PP-OCRv4
detector as frames through a registered shared memory region).

Each start: spawn, wait for sd_notify READY=1, register a region per frame model (as a client
does when it starts), then per model a 0.5 s idle gap and the first request on a new connection;
then steady requests; then ``--gaps`` times per model the same gap and one more request on a new
connection. The ratio is first / the median of that start's after-gap requests: one request after
an idle gap is one sample of a noisy machine (on the 16-core host a tiny request after the gap
took 0.9-1.4 ms against 0.12 ms steady), and a ratio of two single samples measured that noise as
much as the first request. Each request also records the client's part (the producer's copy into
the region, connect, send to last byte) and the daemon's minor page faults and thread count around
it (from /proc), so a cold first request shows what it paid for. ``--variants`` alternates
daemons start by start (edged as configured, ONNX Runtime's pool left spinning after a run, other
intra-op thread counts for the frame models, frames through POSIX shared memory or in the request
body, the bare limit servers of bench/limit.py) and reports each. Every edged daemon is started
through bench/stages.py; ``--stages`` turns its timers on (around each stage of the request path:
decode, copy in, hand-off and run, encode, copy out, each with its thread's page faults) and
prints them for the first and the after-gap request.

    scripts/bench.sh first-request [--starts 7] [--gaps 5] [--stages] [--models tiny,conv640,ocr_det]
                                   [--variants default,posix,body,spinning,threads=15]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.edged_server import EdgedServer
from bench.limit_servers import LimitServer, LimitWorkerServer
from bench.measure import AFTER_GAPS, STEADY, _client_conns, _steady
from bench.models import ModelSpec, prepare, write_specs
from bench.servers import Server
from bench.stages import hops
from bench.wire import Conn, connect, roundtrip

REPO = Path(__file__).resolve().parent.parent
GAP_S = 0.5


class StagedEdged(EdgedServer):
    """edged started through bench.stages: the same daemon, with stage timers when
    ``stages_file`` is given, with ONNX Runtime's pool left spinning when ``spinning``."""

    def __init__(
        self,
        work: Path,
        specs: dict[str, ModelSpec],
        stages_file: Path | None,
        options: dict[str, dict[str, Any]] | None = None,
        spinning: bool = False,
        shm: str = "memfd",
        label: str = "edged",
    ) -> None:
        super().__init__(work, specs, options=options, shm=shm, label=label)
        self.stages_file = stages_file
        self.spinning = spinning

    def command(self) -> list[str]:
        return [self.python, "-m", "bench.stages", "serve", "--config", str(self.config())]

    def extra_env(self) -> dict[str, str]:
        env = super().extra_env()
        if self.stages_file is not None:
            env["BENCH_STAGES"] = str(self.stages_file)
        if self.spinning:
            env["BENCH_KEEP_SPINNING"] = "1"
        return env


def variant_server(variant: str, work: Path, specs: dict[str, ModelSpec], stages: Path | None) -> Server:
    """``default``: edged as configured by the benchmark; ``spinning``: ONNX Runtime's pool left
    spinning after each run; ``threads=N``: the frame models with N intra-op threads; ``posix``:
    frames through POSIX shared memory objects (copied with preadv) instead of sealed memfds;
    ``body``: frames in the request's body, as a client without shared memory sends them.
    ``limit`` and ``limitworker``: not edged but the bare servers of bench/limit.py (uvicorn,
    the model run on a held input, on the loop or on a worker thread, a 100-byte answer), started
    fresh the same way: the machine's own first request after an idle gap, the bound for edged's."""
    if variant in ("limit", "limitworker"):
        return (LimitServer if variant == "limit" else LimitWorkerServer)(work, specs)
    if variant == "default":
        return StagedEdged(work, specs, stages)
    if variant in ("posix", "body"):
        return StagedEdged(work, specs, stages, shm=variant)
    if variant == "spinning":
        return StagedEdged(work, specs, stages, spinning=True)
    if variant.startswith("threads="):
        n = int(variant.split("=", 1)[1])
        return StagedEdged(work, specs, stages, options={m: {"threads": n} for m, s in specs.items() if s.frame})
    raise SystemExit(f"unknown variant {variant!r}: default, posix, body, spinning, threads=N, limit or limitworker")


def _proc(pid: int) -> tuple[int, int]:
    """(minor page faults, threads) of the daemon's process, all threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[7]), int(fields[17])


def timed_request(conn: Conn, pid: int) -> dict[str, float]:
    """One request on a fresh connection, in parts: copy into the region, connect, send → the
    last byte of the answer. ``total_ms`` is what the benchmark's ratio uses."""
    flt0, thr0 = _proc(pid)
    t0 = time.perf_counter()
    if conn.before is not None:
        conn.before()
    t1 = time.perf_counter()
    with connect(conn.addr) as s:
        t2 = time.perf_counter()
        roundtrip(s, conn.request)
        t3 = time.perf_counter()
    flt1, thr1 = _proc(pid)
    return {
        "total_ms": (t3 - t0) * 1000,
        "copy_ms": (t1 - t0) * 1000,
        "connect_ms": (t2 - t1) * 1000,
        "roundtrip_ms": (t3 - t2) * 1000,
        "daemon_faults": flt1 - flt0,
        "daemon_new_threads": thr1 - thr0,
    }


def one_start(server: Server, specs: dict[str, ModelSpec], gaps: int) -> dict[str, Any]:
    server.start()
    try:
        ready_s = server.wait_ready()
        conns, _ = _client_conns(server, specs)
        first: dict[str, dict[str, float]] = {}
        after: dict[str, list[dict[str, float]]] = {m: [] for m in conns}
        steady: dict[str, float] = {}
        for m, conn in conns.items():
            time.sleep(GAP_S)  # the idle gap being measured, not synchronisation
            first[m] = timed_request(conn, server.pid)
        for m, conn in conns.items():
            steady[m] = _steady(conn, STEADY[m]) * 1000
        for _ in range(gaps):
            for m, conn in conns.items():
                time.sleep(GAP_S)  # the same gap on a daemon that has served
                after[m].append(timed_request(conn, server.pid))
        server.close_frames()
    except Exception:
        print(f"{server.name}'s log:\n{server.log_tail(6000)}", file=sys.stderr)
        raise
    finally:
        server.stop()
    return {"ready_s": ready_s, "first": first, "after_gap": after, "steady_ms": steady}


def after_ms(start: dict[str, Any], model: str) -> float:
    """The reference of a start's first request: the median of its requests after the same gap."""
    return statistics.median(r["total_ms"] for r in start["after_gap"][model])


def _stage_lines(path: Path, models: list[str], gaps: int) -> list[str]:
    """The daemon's own stage timings of the last start: its first and its last after-gap request
    per model (the warm-up's requests through the app come before them)."""
    if not path.exists():
        return ["(no stage records: the daemon did not write BENCH_STAGES)"]
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    out = []
    for m in models:
        mine = [r for r in recs if r["path"] == f"/v2/models/{m}/infer"]
        if len(mine) < STEADY[m] + 1 + gaps:
            continue
        # first request, steady requests, the requests after the gaps
        first, after = mine[-(STEADY[m] + 1 + gaps)], mine[-1]
        for label, r in (("first", first), ("after gap", after)):
            parts = ", ".join(f"{k} {v:.3f}" for k, v in r["ms"].items())
            faults = sum(r["faults"].values())
            out.append(f"  {m} {label} (ms): {parts}; {_hops(r['at_ms'])}; {faults} faults")
    return out


def _hops(at: dict[str, list[float]]) -> str:
    """The hand-offs between threads: loop → copier thread → loop, loop → model worker → loop."""
    found = [f"{name} {there:.3f} / back {back:.3f}" for name, (there, back) in hops(at).items()]
    return ", ".join(found) or "no hand-offs"


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    wanted = args.models.split(",")
    specs = {m: s for m, s in prepare(REPO / "data", REPO / "data" / "bench").items() if m in wanted}
    work = Path(tempfile.mkdtemp(prefix="edged-first-"))
    variants = args.variants.split(",")
    starts: list[dict[str, Any]] = []
    try:
        _measure_starts(args, work, specs, variants, starts)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratios = {
        v: {m: [s["first"][m]["total_ms"] / after_ms(s, m) for s in starts if s["variant"] == v] for m in specs}
        for v in variants
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"starts": starts, "ratios": ratios, "stages": args.stages}, indent=2))
    _print_ratios(args, specs, starts, ratios)
    sys.stdout.flush()


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line, with ``--gaps`` checked."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--starts", type=int, default=7)
    ap.add_argument("--gaps", type=int, default=AFTER_GAPS, help="requests after the same idle gap per model and start")
    ap.add_argument("--stages", action="store_true", help="daemon-side stage timers (bench.stages)")
    ap.add_argument("--models", default="tiny,conv640,ocr_det")
    ap.add_argument(
        "--variants",
        default="default",
        help="comma-separated, alternated start by start: default, posix, body, spinning, threads=N, limit(worker)",
    )
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "first_request.json")
    args = ap.parse_args(argv)
    if args.gaps < 1:
        ap.error("--gaps: at least one request after the gap is the reference")
    return args


def _measure_starts(
    args: argparse.Namespace,
    work: Path,
    specs: dict[str, ModelSpec],
    variants: list[str],
    starts: list[dict[str, Any]],
) -> None:
    """Build the engine cache once, then ``--starts`` fresh starts of each variant, alternated,
    each appended to ``starts`` and printed as it ends."""
    write_specs(work / "specs.json", specs)
    warm = EdgedServer(work, specs)  # builds the cache: every measured start is a cache hit
    warm.start()
    warm.wait_ready()
    warm.wait_built()
    warm.stop()
    for i in range(args.starts * len(variants)):
        variant = variants[i % len(variants)]
        stages = work / f"stages-{i}.jsonl"
        r = one_start(variant_server(variant, work, specs, stages if args.stages else None), specs, args.gaps)
        r["variant"] = variant
        starts.append(r)
        print(
            f"start {i} {variant} (ready {r['ready_s']:.2f} s): "
            + "; ".join(_describe(m, r) for m in specs)
            + ("\n" + "\n".join(_stage_lines(stages, list(specs), args.gaps)) if args.stages else ""),
            flush=True,
        )


def _print_ratios(
    args: argparse.Namespace,
    specs: dict[str, ModelSpec],
    starts: list[dict[str, Any]],
    ratios: dict[str, dict[str, list[float]]],
) -> None:
    """Per variant, first / after-gap ratios and steady latency per model, then each model's spread."""
    for v, by_model in ratios.items():
        mine = [s for s in starts if s["variant"] == v]
        steady = {m: statistics.median(s["steady_ms"][m] for s in mine) for m in specs}
        print(
            f"{v}: first / median of {args.gaps} after the same {GAP_S} s gap, over {args.starts} fresh starts"
            + (" (stage timers on)" if args.stages else "")
            + ": "
            + ", ".join(f"{m} median {statistics.median(r):.2f}x (worst {max(r):.2f}x)" for m, r in by_model.items())
            + "; steady median "
            + ", ".join(f"{m} {ms:.3f} ms" for m, ms in steady.items())
        )
        for m in specs:
            print("  " + _spread(m, mine))


def _spread(m: str, starts: list[dict[str, Any]]) -> str:
    """Where the first requests fall among all requests after the gap: a first request within
    their spread is one the machine's noise could have made."""
    firsts = sorted(s["first"][m]["total_ms"] for s in starts)
    after = sorted(r["total_ms"] for s in starts for r in s["after_gap"][m])
    above = sum(f > after[-1] for f in firsts)
    return (
        f"{m}: first requests {firsts[0]:.3f}-{firsts[-1]:.3f} ms (median {statistics.median(firsts):.3f}); "
        f"{len(after)} after the gap {after[0]:.3f}-{after[-1]:.3f} ms (median {statistics.median(after):.3f}); "
        f"{above} of {len(firsts)} first requests slower than every one after the gap"
    )


def _describe(m: str, r: dict[str, Any]) -> str:
    """The first request against the median of this start's requests after the gap, and its parts
    against those of the middle one of them."""
    f = r["first"][m]
    after = sorted(r["after_gap"][m], key=lambda a: float(a["total_ms"]))
    a = after[len(after) // 2]
    return (
        f"{m} {f['total_ms']:.3f}/{after_ms(r, m):.3f} ms = {f['total_ms'] / after_ms(r, m):.2f}x "
        f"(after the gap {after[0]['total_ms']:.3f}-{after[-1]['total_ms']:.3f}; parts of the first and the middle "
        f"one: copy {f['copy_ms']:.3f}/{a['copy_ms']:.3f}, connect {f['connect_ms']:.3f}/{a['connect_ms']:.3f}, "
        f"faults {f['daemon_faults']}/{a['daemon_faults']}, "
        f"threads +{f['daemon_new_threads']}/+{a['daemon_new_threads']})"
    )


if __name__ == "__main__":
    main()
