"""Intra-op threads against one run's time and CPU, in process: what edged/serving/threadpick.py decides on.

Each model alone, sessions made as edged serves them (``session.force_spinning_stop``, one
inter-op thread, sequential), one per thread count (1, 2, 4, 8 and the cores this process may use),
measured in blocks alternated round-robin with a pause between blocks. Prints, per count, the
median run time and the process CPU time per run (the pool's threads included), and the ratio to
the all-cores session.

    scripts/bench.sh threads [--rounds 6] [--models tiny,mlp2k,conv640,ocr_det] [--out bench-results/threads.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from bench.models import ModelSpec, probe_specs, session

REPO = Path(__file__).resolve().parent.parent
PAUSE_S = 0.05
PER_BLOCK_S = 0.05  # runs per block: as many as fit in this, at least 3

SERVING = {"session.force_spinning_stop": "1", "session.x64quantprecision": "1"}


def counts() -> list[int]:
    cores = len(os.sched_getaffinity(0))
    return sorted({n for n in (1, 2, 4, 8) if n < cores} | {cores})


def measure(spec: ModelSpec, rounds: int) -> dict[int, dict[str, float]]:
    x = spec.sample()
    sessions = {n: session(spec, n, SERVING) for n in counts()}
    feed = {spec.input: x}
    for s in sessions.values():
        for _ in range(3):
            s.run(None, feed)
    t0 = time.perf_counter()
    sessions[max(sessions)].run(None, feed)
    per = max(3, int(PER_BLOCK_S / max(time.perf_counter() - t0, 1e-6)))
    wall: dict[int, list[float]] = {n: [] for n in sessions}
    cpu: dict[int, list[float]] = {n: [] for n in sessions}
    for r in range(rounds):
        order = list(sessions)
        for n in order[r % len(order) :] + order[: r % len(order)]:
            time.sleep(PAUSE_S)
            s, times = sessions[n], []
            c0 = time.process_time()
            for _ in range(per):
                t = time.perf_counter()
                s.run(None, feed)
                times.append(time.perf_counter() - t)
            cpu[n].append((time.process_time() - c0) / per * 1e6)
            wall[n].append(statistics.median(times) * 1e6)
    return {n: {"wall_us": statistics.median(wall[n]), "cpu_us": statistics.median(cpu[n])} for n in sessions}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="bench threads", description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--models", default="tiny,mlp2k,conv640,ocr_det")
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "threads.json")
    args = ap.parse_args(argv)
    specs = probe_specs(REPO)
    out: dict[str, Any] = {"cores": len(os.sched_getaffinity(0)), "models": {}}
    for name in [m for m in args.models.split(",") if m]:
        res = measure(specs[name], args.rounds)
        full = res[max(res)]["wall_us"]
        for n, d in res.items():
            print(
                f"{name:8} threads {n:2}: run {d['wall_us']:10.1f} us ({d['wall_us'] / full:5.2f}x all cores)  "
                f"CPU {d['cpu_us']:10.1f} us a run",
                flush=True,
            )
        out["models"][name] = {str(n): d for n, d in res.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
