"""Probe: does the first request after READY=1 pay for the socket path that the daemon's own
warm-up (edged.warmpath, which calls the ASGI app directly) never exercises?

Fresh edged starts, alternating: readiness from sd_notify then the first request (as systemd and
the benchmark see it), against the same with one GET /v2/health/live through the socket right
after READY=1 (what warming through the real socket would do). Each start reports, per model, the
first request after a 0.5 s idle gap over the request after the same gap on the warm daemon.

    scripts/bench.sh first-request [--starts 6]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

from bench.measure import cold_start
from bench.models import prepare, write_specs
from bench.servers import EdgedServer

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--starts", type=int, default=6)
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "first_request.json")
    args = ap.parse_args(argv)
    specs = prepare(REPO / "data", REPO / "data" / "bench")
    work = Path(tempfile.mkdtemp(prefix="edged-probe-"))
    ratios: dict[bool, dict[str, list[float]]] = {False: {}, True: {}}
    try:
        write_specs(work / "specs.json", specs)
        cold_start(EdgedServer(work, specs), specs, 0.1)  # builds the cache
        for i in range(2 * args.starts):
            touch = bool(i % 2)
            r = cold_start(EdgedServer(work, specs), specs, 0.5, touch=touch)
            for m in specs:
                ratios[touch].setdefault(m, []).append(r["first_ms"][m] / r["after_gap_ms"][m])
            print(
                f"start {i} touch={touch}: "
                + ", ".join(f"{m} {r['first_ms'][m]:.3f}/{r['after_gap_ms'][m]:.3f} ms" for m in specs),
                flush=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"socket_touched" if t else "ready_only": v for t, v in ratios.items()}, indent=2))
    for touch, by_model in ratios.items():
        label = "one GET through the socket after READY=1" if touch else "READY=1 only"
        print(
            f"{label}: first / after gap, median: "
            + ", ".join(f"{m} {statistics.median(v):.2f}x (worst {max(v):.2f}x)" for m, v in by_model.items())
        )


if __name__ == "__main__":
    main()
