"""edged against PyTriton, a hand-written FastAPI server and the in-process floor on the same
ONNX models, in one run, as ratios to the floor measured in that run.

    scripts/bench.sh peers [--quick] [--out bench-results] [--publish docs/img]
    (sets up bench/.venv for PyTriton and the models, then runs this)

Phases: cold start (fresh starts interleaved across servers: start → ready, first request, memory),
serving (latency and throughput at each concurrency, every target round-robin, with the limit
lanes of bench/limit.py: the same socket stack running the model on its loop, what the machine
allows any server, on a worker thread, what it allows a server that keeps its loop free during a
run, and with the protocol's decode and encode around the run, the least a V2 server does; the
targets table says where a bound is past them), and edged's
scheduler (dynamic batching and instances against none). Output: bench.json, bench.md and PNGs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench import measure, report, report_markdown, report_plots
from bench.edged_server import EdgedServer
from bench.limit_servers import LimitServer, LimitV2Server, LimitWorkerServer
from bench.measure import Budget, Series
from bench.models import ModelSpec, batchable, prepare, write_specs
from bench.peer_servers import FastAPIServer, PyTritonServer
from bench.report import TWIN
from bench.servers import Server

REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Plan:
    rounds: int
    starts: int
    sched_rounds: int
    budgets: dict[str, Budget]
    concurrencies: tuple[int, ...] = (1, 4, 16)
    gap_s: float = 0.5
    # Starts of every server in the serving phase, the rounds shared among them: a start's threads
    # stay where they first land, and two daemons of the same code differed by up to 29% at c=4 in
    # one start each (docs/performance.md, "The A/A spread").
    serving_starts: int = 1


QUICK = Plan(
    rounds=2,
    starts=2,
    serving_starts=2,
    sched_rounds=2,
    budgets={"tiny": Budget(3000, 0.3), "conv640": Budget(600, 0.4), "ocr_det": Budget(60, 1.0)},
)
SMOKE = Plan(
    rounds=1,
    starts=1,
    sched_rounds=1,  # checks the harness itself, not a measurement
    budgets={"tiny": Budget(300, 0.1), "conv640": Budget(60, 0.1), "ocr_det": Budget(8, 0.3)},
)
FULL = Plan(
    rounds=6,
    starts=4,
    serving_starts=3,
    sched_rounds=5,
    budgets={"tiny": Budget(6000, 0.5), "conv640": Budget(1500, 0.6), "ocr_det": Budget(120, 1.5)},
)


def machine() -> dict[str, Any]:
    import onnxruntime as ort

    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), "")
    mem = next((int(ln.split()[1]) for ln in meminfo if ln.startswith("MemTotal")), 0)
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "memory_gib": round(mem / 2**20, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "onnxruntime": ort.__version__,
        "loadavg_start": os.getloadavg(),
    }


@contextmanager
def running(servers: list[Server]) -> Iterator[list[Server]]:
    try:
        for s in servers:
            s.start()
            s.wait_ready()
        yield servers
    finally:
        for s in servers:
            s.stop()


def peers(work: Path, specs: dict[str, ModelSpec]) -> list[Server]:
    servers: list[Server] = [EdgedServer(work, specs), FastAPIServer(work, specs)]
    if PyTritonServer.available():
        servers.append(PyTritonServer(work, specs))
    else:
        log("PyTriton is not set up (bench/.venv): scripts/bench.sh builds it; running without it")
    return servers


def cold_starts(work: Path, specs: dict[str, ModelSpec], plan: Plan) -> dict[str, list[dict[str, Any]]]:
    """One unrecorded start each (edged builds its cache, every server's files reach the page
    cache), then ``starts`` fresh starts, interleaved across servers."""
    servers = peers(work, specs)
    out: dict[str, list[dict[str, Any]]] = {s.name: [] for s in servers}
    for i in range(plan.starts + 1):
        for s in servers:
            log(f"cold start {i}/{plan.starts}: {s.name}")
            result = measure.cold_start(s, specs, plan.gap_s)
            if i:
                out[s.name].append(result)
    return out


def scheduler_phase(work: Path, specs: dict[str, ModelSpec], plan: Plan) -> dict[str, Any]:
    """edged serving the same models under several scheduler settings, side by side: batching
    (max_batch with a queue delay) and instances against the defaults."""
    tiny, conv, det, mlp = specs["tiny"], specs["conv640"], specs["ocr_det"], batchable(REPO / "data" / "bench")
    batch16 = {"max_batch": 16, "max_queue_delay_us": 1000}
    variants = {
        "tiny_b1": (tiny, {}),
        "tiny_b16": (tiny, batch16),
        "mlp2k_b1": (mlp, {}),
        "mlp2k_b16": (mlp, batch16),
        "conv640_b1": (conv, {}),
        "conv640_b8": (conv, {"max_batch": 8, "max_queue_delay_us": 2000}),
        "conv640_i2": (conv, {"instances": 2, "threads": 0}),
        "ocr_det_b1": (det, {}),
        "ocr_det_i2": (det, {"instances": 2, "threads": 0}),
    }
    vspecs = {n: dataclasses.replace(s, name=n) for n, (s, _) in variants.items()}
    server = EdgedServer(work, vspecs, {n: o for n, (_, o) in variants.items()}, label="edged-scheduler")
    b = dict(plan.budgets, mlp2k=plan.budgets["tiny"])
    cases = [(n, c, b[n.rsplit("_", 1)[0]]) for n in ("tiny_b1", "tiny_b16", "mlp2k_b1", "mlp2k_b16") for c in (16, 1)]
    cases += [(n, 16, b["conv640"]) for n in ("conv640_b1", "conv640_b8", "conv640_i2")]
    cases += [(n, 4, b[n.rsplit("_", 1)[0]]) for n in ("conv640_b1", "conv640_i2", "ocr_det_b1", "ocr_det_i2")]
    failures = []
    for _attempt in range(2):  # a start that never gets ready is recorded (stacks, log) and retried once
        try:
            with running([server]):
                result = measure.scheduler(server, cases, plan.sched_rounds)
            break
        except RuntimeError as e:
            log(f"scheduler phase: {str(e)[:4000]}")
            failures.append(str(e))
    else:
        result = {"series": {}, "status": {}}
    result["variants"] = {n: o for n, (_, o) in variants.items()}
    result["failures"] = failures
    return result


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rounds and starts (a few minutes)")
    ap.add_argument("--out", default=str(REPO / "bench-results"), help="where bench.json, bench.md, PNGs go")
    ap.add_argument("--publish", default="", help="also copy the PNGs into this folder (docs/img)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (server logs)")
    ap.add_argument("--report-only", action="store_true", help="redo the report from the last run's raw.pkl")
    ap.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        raw = pickle.loads((out / "raw.pkl").read_bytes())
    else:
        raw = measure_all(
            SMOKE if args.smoke else QUICK if args.quick else FULL,
            "smoke" if args.smoke else "quick" if args.quick else "full",
            args.keep,
        )
        (out / "raw.pkl").write_bytes(pickle.dumps(raw))
    write_report(raw, out, args.publish)
    return 0


def measure_all(plan: Plan, mode: str, keep: bool) -> dict[str, Any]:
    started = time.monotonic()
    specs = prepare(REPO / "data", REPO / "data" / "bench")
    results: dict[str, Any] = {
        "machine": machine(),
        "mode": mode,
        "plan": dataclasses.asdict(plan),
        "models": {n: s.to_json() for n, s in specs.items()},
    }
    work = Path(tempfile.mkdtemp(prefix="edged-bench-"))
    try:
        write_specs(work / "specs.json", specs)
        results["cold_start"] = cold_starts(work, specs, plan)
        limits = [LimitServer(work, specs), LimitWorkerServer(work, specs), LimitV2Server(work, specs)]
        twin = EdgedServer(work, specs, label=TWIN)  # the A/A spread, beside edged's targets
        with running([twin]):  # unrecorded: it builds its own cache, as edged did in its cold starts
            twin.wait_built()
        everyone = [*peers(work, specs), twin, *limits]
        series: dict[str, dict[str, dict[int, Series]]] = {}
        shares = measure.rounds_per_start(plan.rounds, plan.serving_starts)
        starts = len(shares)
        for k, rounds in enumerate(shares):
            log(f"serving: every server up (start {k + 1} of {starts}), {rounds} interleaved rounds")
            with running(everyone) as servers:
                part = measure.serving(servers, specs, plan.concurrencies, rounds, plan.budgets)
            for model, by_server in part.items():
                measure.merge(series.setdefault(model, {}), by_server)
        log("scheduler: batching and instances")
        sched = scheduler_phase(work, specs, plan)
    finally:
        if keep:
            log(f"work folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    results["machine"]["loadavg_end"] = os.getloadavg()
    results["elapsed_s"] = time.monotonic() - started
    return {"results": results, "series": series, "sched": sched}


def write_report(raw: dict[str, Any], out: Path, publish: str) -> None:
    results, series = raw["results"], raw["series"]
    results["serving"] = report.summarize(series)
    results["scheduler"] = report.summarize_scheduler(raw["sched"])
    results["targets"] = report.targets(results)
    (out / "bench.json").write_text(json.dumps(results, indent=1))
    pngs = report_plots.plots(series, results, out)
    (out / "bench.md").write_text(report_markdown.markdown(results, [p.name for p in pngs]))
    if publish:
        Path(publish).mkdir(parents=True, exist_ok=True)
        for p in pngs:
            shutil.copy(p, Path(publish) / p.name)
    print((out / "bench.md").read_text())
    log(f"report in {out}; the run took {results['elapsed_s']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
