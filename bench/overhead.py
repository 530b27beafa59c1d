"""Probe: where a request's time goes outside the model, with trial fixes side by side.

Three daemons serve the same model, interleaved with the in-process floor, at concurrency 1 and 4:
  * ``edged``: as configured by default;
  * ``edged-onewrite``: uvicorn's httptools protocol writes a response's head and body with two
    ``transport.write`` calls (two ``write`` syscalls, seen with strace on the daemon);
    bench/trials/onewrite/sitecustomize.py coalesces them, without touching edged's code;
  * ``edged-inline``: ``[server] inline_threshold_us`` high enough that the model runs on the
    event loop: no hand-off to a worker thread and back (for the frame models; the tiny model
    runs inline already).

    scripts/bench.sh overhead [--model tiny|conv640|ocr_det] [--rounds 8]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import numpy as np

from bench.measure import FLOOR, Budget, Lane, Runner, floor_runner, interleave, server_runner
from bench.models import ModelSpec, prepare, session, write_specs
from bench.servers import EdgedServer, check
from bench.wire import closed_loop

REPO = Path(__file__).resolve().parent.parent


class OneWriteEdged(EdgedServer):
    def extra_env(self) -> dict[str, str]:
        return dict(super().extra_env(), PYTHONPATH=f"{REPO / 'bench' / 'trials' / 'onewrite'}:{REPO}")


def _no_copy(server: EdgedServer, spec: ModelSpec, x: np.ndarray, conc: int) -> Runner:
    conns = [server.frame_conn(spec, x, i) for i in range(conc)]
    for conn in conns:
        conn.before = None  # the region already holds the frame

    def run(max_requests: int, max_seconds: float) -> tuple[list[float], float]:
        return closed_loop(conns, max_requests, max_seconds)

    return run


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--model", default="tiny")
    args = ap.parse_args(argv)
    specs = prepare(REPO / "data", REPO / "data" / "bench")
    spec = specs[args.model]
    work = Path(tempfile.mkdtemp(prefix="edged-probe-"))
    servers = [
        EdgedServer(work, {spec.name: spec}, label="edged"),
        OneWriteEdged(work, {spec.name: spec}, label="edged-onewrite"),
    ]
    if spec.frame:
        servers.append(
            EdgedServer(work, {spec.name: spec}, label="edged-inline", server={"inline_threshold_us": 10_000_000})
        )
    budget = Budget(3000, 0.3) if not spec.frame else Budget(300, 0.5)
    try:
        write_specs(work / "specs.json", specs)
        for s in servers:
            s.start()
            s.wait_ready()
        x = spec.sample()
        sess = session(spec)
        want = sess.run([spec.outputs[0]], {spec.input: x})[0]
        lanes = {(FLOOR, c): Lane(floor_runner(sess, spec, x, c), budget) for c in (1, 4)}
        for s in servers:
            check(s, spec, x, want)
            for c in (1, 4):
                lanes[(s.name, c)] = Lane(server_runner(s, spec, x, c), budget)
        if spec.frame:  # the producer writes its frame into the region in place: no copy per request
            for c in (1, 4):
                lanes[("edged, frame in place", c)] = Lane(_no_copy(servers[0], spec, x, c), budget)
        for name, by_conc in interleave(lanes, args.rounds).items():
            for c, series in by_conc.items():
                d = series.summary()
                print(
                    f"{spec.name} {name:22} c={c}  p50 {d['p50_ms']:.4f} ms  p90 {d['p90_ms']:.4f}  "
                    f"p99 {d['p99_ms']:.4f} ms  {d['throughput_rps']:8.0f} req/s",
                    flush=True,
                )
    finally:
        for s in servers:
            s.close_frames()
            s.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
