#!/usr/bin/env python3
"""edged against its floor, side by side in one run (this machine is shared and noisy).

  scripts/bench.sh core [--quick] [--out bench-results/core.json]

Measures, on the same models:
  * the tiny MLP: in-process ONNX Runtime (the floor) against edged over the socket (binary
    tensor extension, a lean pre-encoded client so the figure is the daemon's, not the client's);
  * the demo detector on a 1x3x640x640 float32 frame: in-process against edged through a
    registered shared memory region;
  * the first request after ready against a request after the same idle gap on a daemon that has
    served for a while (median over several fresh starts);
  * restart to ready on a cache hit.
Rounds interleave floor and daemon so both see the same noise. Results go to JSON; a table prints.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort

REPO = Path(__file__).resolve().parent.parent

from bench.models import demo_onnx  # noqa: E402
from edged.client import Client, encode_request  # noqa: E402
from tests.helpers import DaemonProcess, wait_for, write_config  # noqa: E402


class LeanClient:
    """One keep-alive connection, a pre-encoded request, a minimal response reader."""

    def __init__(self, path: str, request: bytes) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.request = request

    def roundtrip(self) -> bytes:
        self.sock.sendall(self.request)
        buf = b""
        while b"\r\n\r\n" not in buf:
            buf += self.sock.recv(65536)
        head, _, body = buf.partition(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        while len(body) < length:
            body += self.sock.recv(65536)
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(head.decode(errors="replace"))
        return body

    def close(self) -> None:
        self.sock.close()


def http_request(model: str, inputs: dict[str, np.ndarray]) -> bytes:
    body, headers = encode_request(inputs)
    lines = [f"POST /v2/models/{model}/infer HTTP/1.1", "Host: localhost", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def timed(fn: Callable[[], object], n: int) -> list[float]:
    """Seconds of each of ``n`` calls of ``fn``."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def interleaved(a, b, rounds: int, per_round: int) -> tuple[list[float], list[float]]:  # type: ignore[no-untyped-def]
    ta: list[float] = []
    tb: list[float] = []
    for _ in range(rounds):
        ta += timed(a, per_round)
        tb += timed(b, per_round)
    return ta, tb


def summary(samples: list[float]) -> dict[str, float]:
    ms = np.array(samples) * 1000
    return {
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "mean_ms": float(ms.mean()),
        "n": len(samples),
    }


def start_daemon(work: Path, models: Path, name: str = "edged") -> DaemonProcess:
    cfg = write_config(
        work / f"{name}.toml",
        {
            "server": {"socket": str(work / f"{name}.sock")},
            "cache": {"dir": str(work / "cache")},
            "models.tiny": {"path": str(models / "tiny.onnx"), "backend": "onnxruntime", "threads": 1},
            "models.ocr_det": {"path": str(models / "ocr_det.onnx"), "backend": "onnxruntime"},
            "models.ocr_det.profiles.x": {"min": [1, 3, 32, 32], "opt": [1, 3, 640, 640], "max": [1, 3, 1280, 1280]},
        },
    )
    return DaemonProcess(cfg, work / f"{name}.sock", work / f"{name}.log")


def bench_tiny(d: DaemonProcess, models: Path, rounds: int, per: int) -> dict[str, object]:
    x = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
    sess = ort.InferenceSession(str(models / "tiny.onnx"), providers=["CPUExecutionProvider"])
    lean = LeanClient(str(d.socket), http_request("tiny", {"x": x}))
    timed(lambda: sess.run(None, {"x": x}), 200)
    timed(lean.roundtrip, 200)
    floor, daemon = interleaved(lambda: sess.run(None, {"x": x}), lean.roundtrip, rounds, per)
    lean.close()
    with Client(str(d.socket)) as c:
        client_times = timed(lambda: c.infer("tiny", {"x": x}), per)
    return {"floor": summary(floor), "edged": summary(daemon), "edged_python_client": summary(client_times)}


def bench_frame(d: DaemonProcess, models: Path, rounds: int, per: int) -> dict[str, object]:
    frame = np.random.default_rng(1).random((1, 3, 640, 640), dtype=np.float32)
    sess = ort.InferenceSession(str(models / "ocr_det.onnx"), providers=["CPUExecutionProvider"])
    with Client(str(d.socket)) as c:
        c.infer_shm("ocr_det", {"x": frame})  # creates and registers the region once
        timed(lambda: sess.run(None, {"x": frame}), 3)
        floor, daemon = interleaved(
            lambda: sess.run(None, {"x": frame}), lambda: c.infer_shm("ocr_det", {"x": frame}), rounds, per
        )
    return {"floor": summary(floor), "edged_shm": summary(daemon)}


def first_vs_steady(work: Path, models: Path, starts: int, gap: float) -> dict[str, object]:
    x = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
    req = http_request("tiny", {"x": x})
    firsts, steadies, ready_s = [], [], []
    for i in range(starts):
        d = start_daemon(work, models, f"cold{i}")
        t0 = time.perf_counter()
        d.start(wait_ready=False)
        wait_for(lambda d=d: os.path.exists(d.socket) and Client(str(d.socket), timeout=2).ready(), 60, 0.005, "ready")
        ready_s.append(time.perf_counter() - t0)
        time.sleep(gap)  # the idle gap being measured, not synchronisation
        firsts.append(_one(d, req))
        lean = LeanClient(str(d.socket), req)
        timed(lean.roundtrip, 500)
        lean.close()
        time.sleep(gap)
        steadies.append(_one(d, req))
        d.stop()
    return {
        "first_ms": [t * 1000 for t in firsts],
        "steady_after_gap_ms": [t * 1000 for t in steadies],
        "ratio_median": statistics.median(firsts) / statistics.median(steadies),
        "gap_s": gap,
        "start_to_ready_s": ready_s,
        "start_to_ready_median_s": statistics.median(ready_s),
    }


def _one(d: DaemonProcess, req: bytes) -> float:
    """One request on a fresh connection, as a client that just started would send it."""
    t0 = time.perf_counter()
    lean = LeanClient(str(d.socket), req)
    lean.roundtrip()
    t = time.perf_counter() - t0
    lean.close()
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(REPO / "bench-results" / "core.json"))
    args = ap.parse_args(argv)
    rounds, per, frame_per, starts = (5, 200, 4, 3) if args.quick else (10, 500, 8, 7)
    data = REPO / "data"
    demo_onnx(data)
    models = data / "models"
    results: dict[str, object] = {
        "machine": {
            "cpus": os.cpu_count(),
            "affinity": sorted(os.sched_getaffinity(0)),
            "python": platform.python_version(),
            "onnxruntime": ort.__version__,
            "platform": platform.platform(),
        },
    }
    with tempfile.TemporaryDirectory(prefix="edged-bench-") as tmp:
        work = Path(tmp)
        d = start_daemon(work, models)
        d.start()
        results["tiny"] = bench_tiny(d, models, rounds, per)
        results["frame_640"] = bench_frame(d, models, rounds, frame_per)
        d.stop()
        results["cold_start"] = first_vs_steady(work, models, starts, gap=0.5)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    report(results)
    return 0


def report(r: dict) -> None:  # type: ignore[type-arg]
    t, f, c = r["tiny"], r["frame_640"], r["cold_start"]
    rows = [
        ("tiny MLP, in-process ORT (floor)", t["floor"]["p50_ms"], t["floor"]["p99_ms"], ""),
        (
            "tiny MLP, edged socket (lean client)",
            t["edged"]["p50_ms"],
            t["edged"]["p99_ms"],
            f"target p50 <= 0.100 ms; +{t['edged']['p50_ms'] - t['floor']['p50_ms']:.3f} ms over floor",
        ),
        (
            "tiny MLP, edged socket (edged.client)",
            t["edged_python_client"]["p50_ms"],
            t["edged_python_client"]["p99_ms"],
            "",
        ),
        ("1x3x640x640 detector, in-process ORT", f["floor"]["p50_ms"], f["floor"]["p99_ms"], ""),
        (
            "1x3x640x640 detector, edged via shm",
            f["edged_shm"]["p50_ms"],
            f["edged_shm"]["p99_ms"],
            f"ratio {f['edged_shm']['p50_ms'] / f['floor']['p50_ms']:.3f} (target <= 1.10)",
        ),
    ]
    print(f"{'case':<42} {'p50 ms':>9} {'p99 ms':>9}  note")
    for name, p50, p99, note in rows:
        print(f"{name:<42} {p50:>9.3f} {p99:>9.3f}  {note}")
    print(
        f"first request after ready / steady after the same {c['gap_s']} s gap: "
        f"{c['ratio_median']:.2f} (target <= 1.2); first {statistics.median(c['first_ms']):.3f} ms, "
        f"steady {statistics.median(c['steady_after_gap_ms']):.3f} ms"
    )
    print(
        f"process start -> ready on a cache hit (2 models incl. warm-up): median {c['start_to_ready_median_s']:.2f} s"
    )


if __name__ == "__main__":
    sys.exit(main())
