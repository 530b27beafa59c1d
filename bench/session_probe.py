"""Probe: does the way edged builds its ONNX Runtime session cost the model itself anything?

In process, no daemon, no socket: the same model and input run through sessions made

  * ``default``: as the benchmark's floor makes it (online optimisation, ORT_ENABLE_ALL);
  * ``edged``: as edged serves it: the model optimised once at build time (its artefact, made with
    one intra-op thread) and loaded with optimisation off, ``session.force_spinning_stop`` on;
  * ``edged-artefact``: edged's artefact, spinning left on (what the artefact alone costs);
  * ``default+stop``: the floor's session with ``session.force_spinning_stop`` (what the stop costs);
  * ``edged-thread``: edged's session run by a worker thread, handed each run through a queue
    and waited for (what edged's scheduler does, without the daemon around it),

in blocks alternated round-robin, with a pause between blocks so that no pool's spinning runs
into the next block. Prints the median of per-block medians and the ratio to ``default``.

    scripts/bench.sh session [--model ocr_det|conv640] [--rounds 8] [--per 20]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import queue
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from bench.models import demo_onnx, make_conv640

REPO = Path(__file__).resolve().parent.parent
PAUSE_S = 0.05


def options(threads: int, stop: bool, optimise: bool) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    if stop:
        so.add_session_config_entry("session.force_spinning_stop", "1")
    if not optimise:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return so


def artefact(model: Path, dest: Path) -> Path:
    """What edged's build writes (backends/onnxruntime.py build)."""
    so = options(1, False, True)
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.optimized_model_filepath = str(dest)
    ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
    return dest


def on_a_thread(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` run by a daemon thread of its own; the caller hands each call over and waits."""
    todo: queue.SimpleQueue[concurrent.futures.Future[Any]] = queue.SimpleQueue()

    def worker() -> None:
        while True:
            fut = todo.get()
            fut.set_result(fn())

    threading.Thread(target=worker, daemon=True).start()

    def call() -> Any:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        todo.put(fut)
        return fut.result()

    return call


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="ocr_det", choices=["ocr_det", "conv640"])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--per", type=int, default=20)
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "session_probe.json")
    args = ap.parse_args(argv)
    threads = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="edged-session-") as tmp:
        if args.model == "ocr_det":
            demo_onnx(REPO / "data")
            model = REPO / "data" / "models" / "ocr_det.onnx"
        else:
            model = make_conv640(Path(tmp) / "conv640.onnx")
        built = artefact(model, Path(tmp) / "artefact.onnx")
        sessions = {
            "default": (model, options(threads, False, True)),
            "edged": (built, options(threads, True, False)),
            "edged-artefact": (built, options(threads, False, False)),
            "default+stop": (model, options(threads, True, True)),
        }
        x = np.random.default_rng(1).random((1, 3, 640, 640), dtype=np.float32)
        runs: dict[str, Callable[[], Any]] = {}
        for name, (path, so) in sessions.items():
            sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
            runs[name] = lambda s=sess: s.run(None, {"x": x})
            for _ in range(3):
                runs[name]()
        runs["edged-thread"] = on_a_thread(runs["edged"])
        blocks: dict[str, list[float]] = {k: [] for k in runs}
        for r in range(args.rounds):
            order = list(runs)[r % len(runs) :] + list(runs)[: r % len(runs)]
            for name in order:
                time.sleep(PAUSE_S)  # lets the previous block's pool go idle
                ts = []
                for _ in range(args.per):
                    t0 = time.perf_counter()
                    runs[name]()
                    ts.append(time.perf_counter() - t0)
                blocks[name].append(statistics.median(ts) * 1000)
    base = statistics.median(blocks["default"])
    result = {
        name: {"p50_ms": statistics.median(b), "ratio": statistics.median(b) / base} for name, b in blocks.items()
    }
    for name, r in result.items():
        print(f"{args.model} {name:<15} {r['p50_ms']:.3f} ms  {r['ratio']:.3f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "threads": threads, "blocks": blocks, "result": result}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
