"""Probe: what ONNX Runtime's spinning intra-op threads cost on a small, shared machine.

After each run, a session's intra-op pool threads spin for a while waiting for more work. On two
cores shared with a client, the daemon's event loop and other processes, the spinning threads
take the cores the next piece of work needs. This compares, interleaved, the frame models in
process and served by edged, each with spinning on (ONNX Runtime's default, what edged does) and
off (``session.intra_op.allow_spinning = 0``; for edged through bench/trials/nospin/sitecustomize.py,
which patches the session options without touching edged's code).

    scripts/bench.sh spinning [--rounds 4]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path
from typing import Any

from bench import models
from bench.measure import FLOOR, Budget, Lane, floor_runner, interleave, server_runner
from bench.models import ModelSpec, prepare, write_specs
from bench.servers import EdgedServer, check

REPO = Path(__file__).resolve().parent.parent


class NoSpinEdged(EdgedServer):
    def extra_env(self) -> dict[str, str]:
        return dict(super().extra_env(), PYTHONPATH=f"{REPO / 'bench' / 'trials' / 'nospin'}:{REPO}")


def session(spec: ModelSpec, spin: bool) -> Any:
    return models.session(spec, config=None if spin else {"session.intra_op.allow_spinning": "0"})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    specs = prepare(REPO / "data", REPO / "data" / "bench")
    frames = {m: s for m, s in specs.items() if s.frame}
    budgets = {"conv640": Budget(600, 0.5), "ocr_det": Budget(40, 1.0)}
    work = Path(tempfile.mkdtemp(prefix="edged-probe-"))
    servers = [EdgedServer(work, frames, label="edged-spin"), NoSpinEdged(work, frames, label="edged-nospin")]
    try:
        write_specs(work / "specs.json", specs)
        for s in servers:
            s.start()
            s.wait_ready()
        for m, spec in frames.items():
            x = spec.sample()
            lanes = {}
            for spin in (True, False):
                sess = session(spec, spin)
                want = sess.run([spec.outputs[0]], {spec.input: x})[0]
                for c in (1, 4):
                    lanes[(f"{FLOOR} spin={spin}", c)] = Lane(floor_runner(sess, spec, x, c), budgets[m])
            for s in servers:
                check(s, spec, x, want)
                for c in (1, 4):
                    lanes[(s.name, c)] = Lane(server_runner(s, spec, x, c), budgets[m])
            result = interleave(lanes, args.rounds)
            for name, by_conc in result.items():
                for c, series in by_conc.items():
                    d = series.summary()
                    print(
                        f"{m:8} {name:24} c={c}  p50 {d['p50_ms']:8.3f} ms  p99 {d['p99_ms']:8.3f} ms  "
                        f"{d['throughput_rps']:7.1f} req/s",
                        flush=True,
                    )
            for s in servers:
                s.close_frames()
    finally:
        for s in servers:
            s.close_frames()
            s.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
