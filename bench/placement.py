"""Where the daemon's threads run, and what that costs a request, on this machine.

The same edged daemon serves the tiny MLP (over the socket, lean pre-encoded client) and a
1x3x640x640 conv net (through a registered shared memory region), under several CPU placements
and intra-op thread settings; each variant is measured in blocks alternated with blocks of the
in-process floor, with a pause between blocks so that neither side's spinning thread pool runs
into the other's (design brief, section 2). A bare uvicorn echo on a Unix socket is the limit of
the transport. The client is pinned to CPU 0 throughout.

    scripts/bench.sh placement [--rounds 6] [--per 300] [--out bench-results/placement.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from bench.core import LeanClient, http_request, timed
from bench.models import demo_onnx, make_conv640
from edged.client import Client
from tests.helpers import DaemonProcess, write_config

REPO = Path(__file__).resolve().parent.parent
PAUSE_S = 0.05  # between blocks: lets the previous side's spinning pool go idle

ECHO_APP = """
import sys, uvicorn
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    body = b'{"outputs":[]}'
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
uvicorn.run(app, uds=sys.argv[1], http="httptools", loop="uvloop", lifespan="off", access_log=False,
            log_level="warning", server_header=False, date_header=False)
"""


def alternate(sides: dict[str, Callable[[], object]], rounds: int, per: int) -> dict[str, list[float]]:
    """Blocks of each side in turn, from a client thread pinned to CPU 0 (only that thread: the
    daemons and the in-process sessions' pools were started unpinned)."""
    times: dict[str, list[float]] = {k: [] for k in sides}
    failure: list[BaseException] = []

    def client() -> None:
        try:
            os.sched_setaffinity(0, {0})  # 0 = the calling thread
            for fn in sides.values():  # warm each side outside the measurement
                timed(fn, max(20, per // 5))
            for _ in range(rounds):
                for name, fn in sides.items():
                    time.sleep(PAUSE_S)
                    times[name] += timed(fn, per)
        except BaseException as e:
            failure.append(e)

    t = threading.Thread(target=client)
    t.start()
    t.join()
    if failure:
        raise failure[0]
    return times


def p50_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def p99_ms(samples: list[float]) -> float:
    return float(np.percentile(np.array(samples) * 1000, 99))


def start_daemon(
    work: Path, tag: str, models: dict[str, Path], cpus: list[int] | None, threads: int, trial: dict[str, str]
) -> DaemonProcess:
    cfg = write_config(
        work / f"{tag}.toml",
        {
            # threads -1: the conv net runs on the event loop, as tiny models do (no worker hop).
            "server": {"socket": str(work / f"{tag}.sock"), "inline_threshold_us": 100_000 if threads < 0 else 60},
            "cache": {"dir": str(work / "cache")},
            "models.tiny": {"path": str(models["tiny"]), "backend": "onnxruntime", "threads": 1},
            "models.conv640": {"path": str(models["conv640"]), "backend": "onnxruntime", "threads": max(0, threads)},
        },
    )
    env = dict(trial)
    if trial:  # session settings edged has no option for: the trial patch in bench/trials/ortopts
        paths = [str(REPO / "bench" / "trials" / "ortopts"), os.environ.get("PYTHONPATH", ""), str(REPO)]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    d = DaemonProcess(cfg, work / f"{tag}.sock", work / f"{tag}.log", env=env)
    d.start()
    if cpus is not None:
        # Every thread of the daemon (the loop, workers, ONNX Runtime's pools) on these CPUs.
        subprocess.run(
            ["taskset", "-a", "-p", "-c", ",".join(map(str, cpus)), str(d.proc.pid)], check=True, capture_output=True
        )
    return d


def thread_affinities(pid: int) -> list[list[int]]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out.append(sorted(os.sched_getaffinity(int(tid))))
        except OSError:
            continue  # the thread ended
    return out


def echo_limit(work: Path, x: np.ndarray, rounds: int, per: int) -> dict[str, float]:
    path = work / "echo.sock"
    proc = subprocess.Popen([sys.executable, "-c", ECHO_APP, str(path)])
    try:
        deadline = time.monotonic() + 30
        while not path.exists():
            if time.monotonic() > deadline:
                raise RuntimeError("echo server did not start")
            time.sleep(0.01)  # polling for a file the child creates, bounded by the deadline
        lean = LeanClient(str(path), http_request("tiny", {"x": x}))
        t = alternate({"echo": lean.roundtrip}, rounds, per)
        lean.close()
        return {"p50_ms": p50_ms(t["echo"]), "p99_ms": p99_ms(t["echo"])}
    finally:
        proc.terminate()
        proc.wait(10)


Variant = tuple[str, "list[int] | None", int, dict[str, str], bool]
SPIN_OFF = {"BENCH_ORT_SPIN": "0"}
NATIVE = {"BENCH_ORT_THREADS": "native"}


def variants(ncpu: int) -> list[Variant]:
    """(label, daemon CPUs or None for all, conv net intra-op threads (0 = edged's rule), trial env,
    frames through a sealed memfd (True, edged's client's default) or a copied POSIX object)."""
    rest = list(range(1, ncpu))
    out: list[Variant] = [
        ("edged: cores/instances threads", None, 0, {}, True),
        ("edged, POSIX shm (copied in and out)", None, 0, {}, False),
        ("edged, spin off", None, 0, SPIN_OFF, True),
        ("ORT's own count, a pinned thread per core", None, 0, NATIVE, True),
        ("1 thread", None, 1, {}, True),
        ("edged, run on the loop (no hand-off)", None, -1, {}, True),
    ]
    if ncpu >= 4:
        out += [("4 threads", None, 4, {}, True)]
        out += [
            (f"edged on cpus 1-{ncpu - 1}", rest, 0, {}, True),
            (f"ORT's own on cpus 1-{ncpu - 1}", rest, 0, NATIVE, True),
        ]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--per", type=int, default=300, help="tiny requests per block")
    ap.add_argument("--frames", type=int, default=30, help="frames per block")
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "placement.json")
    ap.add_argument("--only", default="", help="comma-separated variant numbers (0 = edged's defaults) to run")
    args = ap.parse_args(argv)
    ncpu = os.cpu_count() or 1
    data = REPO / "data"
    demo_onnx(data)
    results: dict[str, Any] = {
        "machine": {
            "cpus": ncpu,
            "python": platform.python_version(),
            "onnxruntime": ort.__version__,
            "platform": platform.platform(),
        }
    }
    x = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
    frame = np.random.default_rng(1).random((1, 3, 640, 640), dtype=np.float32)
    with tempfile.TemporaryDirectory(prefix="edged-placement-") as tmp:
        work = Path(tmp)
        models = {"tiny": data / "models" / "tiny.onnx", "conv640": make_conv640(work / "conv640.onnx")}
        results["echo"] = echo_limit(work, x, args.rounds, args.per)
        tiny_sess = ort.InferenceSession(str(models["tiny"]), providers=["CPUExecutionProvider"])
        default_conv = ort.InferenceSession(str(models["conv640"]), providers=["CPUExecutionProvider"])
        rows = []
        only = {int(n) for n in args.only.split(",") if n}
        for i, (label, cpus, threads, trial, memfd) in enumerate(variants(ncpu)):
            if only and i not in only:
                continue
            d = start_daemon(work, f"d{i}", models, cpus, threads, trial)
            try:
                lean = LeanClient(str(d.socket), http_request("tiny", {"x": x}))
                t = alternate(
                    {"floor": lambda: tiny_sess.run(None, {"x": x}), "edged": lean.roundtrip}, args.rounds, args.per
                )
                lean.close()
                with Client(str(d.socket), memfd=memfd) as c:
                    region = c.shm_region("conv640.x", frame.nbytes)
                    lean_shm = LeanClient(str(d.socket), http_request("conv640", {"x": region.put(frame)}))
                    f = alternate(
                        {
                            "floor": lambda: default_conv.run(None, {"x": frame}),
                            # The producer writes each frame into the region (a copy), then asks.
                            "edged": lambda: c.infer_shm("conv640", {"x": frame}),
                            # The request alone: a camera that writes frames into the region itself.
                            "request": lean_shm.roundtrip,
                            "copy": functools.partial(region.put, frame),
                        },
                        args.rounds,
                        args.frames,
                    )
                    lean_shm.close()
                    status = c.status()
                    threads_cpus = thread_affinities(d.proc.pid)
            finally:
                d.stop()
            row = {
                "variant": label,
                "tiny_floor_p50_ms": p50_ms(t["floor"]),
                "tiny_edged_p50_ms": p50_ms(t["edged"]),
                "tiny_edged_p99_ms": p99_ms(t["edged"]),
                "frame_floor_p50_ms": p50_ms(f["floor"]),
                "frame_edged_p50_ms": p50_ms(f["edged"]),
                "frame_ratio": p50_ms(f["edged"]) / p50_ms(f["floor"]),
                "frame_request_only_p50_ms": p50_ms(f["request"]),
                "frame_request_only_ratio": p50_ms(f["request"]) / p50_ms(f["floor"]),
                "producer_copy_p50_ms": p50_ms(f["copy"]),
                "status": status,
                "daemon_threads_pinned_to_one_cpu": sum(len(cpu_set) == 1 for cpu_set in threads_cpus),
                "daemon_threads": len(threads_cpus),
            }
            rows.append(row)
            print(
                f"{label:<34} tiny {row['tiny_edged_p50_ms']:.3f} ms (floor {row['tiny_floor_p50_ms']:.3f})"
                f"  frame {row['frame_edged_p50_ms']:.3f} / {row['frame_floor_p50_ms']:.3f} ms"
                f" = {row['frame_ratio']:.2f}x; request alone {row['frame_request_only_ratio']:.2f}x,"
                f" producer copy {row['producer_copy_p50_ms']:.3f} ms;"
                f" {row['daemon_threads_pinned_to_one_cpu']}/{row['daemon_threads']} threads pinned",
                flush=True,
            )
        results["variants"] = rows
    print(f"bare uvicorn echo over the socket: p50 {results['echo']['p50_ms']:.3f} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
