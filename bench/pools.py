"""Two instances of one model: a thread pool each (edged's rule, cores / 2 threads apiece; or every
core apiece) against one process-wide pool both share (ONNX Runtime's global thread pool, all
cores), in process.

Each mode runs in a child process (the global pool must be set up before the first session):
one run at a time (c=1, a 2 ms pause between runs) and two threads running the two instances
back to back; per mode the median run time, runs per second and process CPU time per run. The
modes alternate, each ``--rounds`` times.

    scripts/bench.sh pools [--models conv640,mlp2k] [--rounds 2] [--out bench-results/pools.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# "session": a pool each of cores / 2 threads (edged's rule for two instances); "wide": a pool each
# of every core (a lone run gets them all, two at once oversubscribe the cores); "global": one
# process-wide pool of every core, shared. "wide" tells apart what more threads give a lone run
# from what sharing one pool does.
MODES = ("session", "wide", "global")


def child(mode: str, path: str, shape: list[int]) -> dict[str, float]:
    import numpy as np
    import onnxruntime as ort
    import onnxruntime.capi._pybind_state as C

    cores = len(os.sched_getaffinity(0))
    if mode == "global":
        C.set_global_thread_pool_sizes(cores, 1)

    def session() -> Any:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.add_session_config_entry("session.force_spinning_stop", "1")
        if mode == "global":
            so.use_per_session_threads = False
        else:
            so.intra_op_num_threads = cores if mode == "wide" else max(1, cores // 2)
        return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])

    pair = [session(), session()]
    feed = {pair[0].get_inputs()[0].name: np.random.default_rng(0).random(shape, dtype=np.float32)}
    for s in pair:
        for _ in range(3):
            s.run(None, feed)
    alone = []
    for _ in range(60):
        time.sleep(0.002)
        t0 = time.perf_counter()
        pair[0].run(None, feed)
        alone.append(time.perf_counter() - t0)
    stop, runs, lat = time.perf_counter() + 2.0, [0, 0], []

    def work(k: int) -> None:
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            pair[k].run(None, feed)
            lat.append(time.perf_counter() - t0)
            runs[k] += 1

    c0, w0 = time.process_time(), time.perf_counter()
    threads = [threading.Thread(target=work, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - w0  # the last run of each thread ends after ``stop``
    return {
        "alone_ms": statistics.median(alone) * 1e3,
        "pair_runs_per_s": sum(runs) / wall,
        "pair_p50_ms": statistics.median(lat) * 1e3,
        "pair_cpu_ms_per_run": (time.process_time() - c0) / sum(runs) * 1e3,
    }


def main(argv: list[str] | None = None) -> None:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]))))
        return
    ap = argparse.ArgumentParser(prog="bench pools", description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="conv640,mlp2k")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "pools.json")
    args = ap.parse_args(argv)
    from bench.models import probe_specs

    specs = probe_specs(REPO)
    out: dict[str, Any] = {"cores": len(os.sched_getaffinity(0)), "models": {}}
    for name in [m for m in args.models.split(",") if m]:
        spec = specs[name]
        got: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
        for _ in range(args.rounds):
            for mode in MODES:
                cmd = [sys.executable, "-m", "bench.pools", "--child", mode, spec.path, json.dumps(list(spec.shape))]
                done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
                if done.returncode != 0 or not done.stdout.strip():
                    raise SystemExit(f"{name} {mode}: the child failed ({done.returncode}):\n{done.stderr[-2000:]}")
                got[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
        out["models"][name] = {}
        for mode, rows in got.items():
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            out["models"][name][mode] = med
            print(
                f"{name:8} {mode:8} one run {med['alone_ms']:.3f} ms | two at once: "
                f"{med['pair_runs_per_s']:.0f} runs/s, p50 {med['pair_p50_ms']:.3f} ms, "
                f"CPU {med['pair_cpu_ms_per_run']:.2f} ms a run",
                flush=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
