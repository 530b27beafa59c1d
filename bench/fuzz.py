"""Fuzz a live daemon with mutated infer requests: JSON bodies, the binary tensor
extension, shared memory parameters and header values, from valid requests mutated at the
document and at the byte level, with a few hostile floods among them; some bodies compressed
(gzip, deflate, and encodings edged does not read) and some BYTES tensors. Beside
them, a tenth as many cases on the descriptor socket (bench/fuzz_fd.py).

    .venv/bin/python -m bench.fuzz [--cases 100000] [--workers 4] [--seed 0] [--out bench-results/fuzz.json]

It starts its own daemon (the tiny model, inline on the event loop, and a two-input model on a
worker thread), registers a shared memory region, and runs the cases over keep-alive
connections while a health prober in its own process checks /v2/health/live back to back.
Counted: answers by status, 5xx (with the first few bodies), daemon crashes, health checks over
1 s (loop stalls) and the slowest one, and the daemon's RSS before and after.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from bench import fuzz_fd
from bench.fuzz_cases import REGION, make_case
from bench.wire import connect, http_bytes
from edged.client import Client
from edged.client.shm import ShmRegion

if TYPE_CHECKING:
    from tests.helpers import DaemonProcess

REPO = Path(__file__).resolve().parent.parent
REGION_BYTES = 4096
STALL_S = 1.0

_PROBER = """
import select, sys, time
from edged.client import Client
times, failed = [], 0
with Client(sys.argv[1], timeout=120) as c:
    assert c.live()
    print("ready", flush=True)
    while not select.select([sys.stdin], [], [], 0)[0]:
        t0 = time.perf_counter()
        try:
            assert c.live()
        except (OSError, AssertionError):
            failed += 1  # no answer within 120 s: a stall too
        times.append(time.perf_counter() - t0)
times.sort()
print(len(times), times[-1] if times else 0.0, sum(t > float(sys.argv[2]) for t in times),
      times[int(len(times) * 0.99)] if times else 0.0, failed, flush=True)
"""


class Results:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.status: Counter[int] = Counter()
        self.codes: Counter[str] = Counter()
        self.server_errors: list[dict[str, Any]] = []
        self.valid_failed: list[dict[str, Any]] = []
        self.connection_errors = 0
        self.done = 0


def _exchange(sock: socket.socket, request: bytes) -> tuple[int, bytes]:
    sock.sendall(request)
    buf = bytearray()
    while True:
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("closed by the daemon")
        buf += chunk
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            continue
        head = bytes(buf[:end]).lower()
        at = head.find(b"\r\ncontent-length:")
        need = end + 4 + int(head[at + 17 :].split(b"\r\n", 1)[0])
        while len(buf) < need:
            chunk = sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("closed mid-response")
            buf += chunk
        return int(head[9:12]), bytes(buf[end + 4 : need])


def worker(addr: str, seed: int, cases: int, out: Results) -> None:
    rng = random.Random(seed)
    sock = connect(addr, timeout=60)
    for _ in range(cases):
        model, body, headers, valid = make_case(rng)
        request = http_bytes(f"/v2/models/{model}/infer", body, {"Content-Type": "application/json", **headers})
        try:
            status, data = _exchange(sock, request)
        except (OSError, ConnectionError, ValueError):
            with out.lock:
                out.connection_errors += 1
            sock.close()
            sock = connect(addr, timeout=60)
            continue
        code = ""
        if status >= 400:
            try:
                code = str(orjson.loads(data).get("code"))
            except (orjson.JSONDecodeError, AttributeError):
                code = "?"
        with out.lock:
            out.done += 1
            out.status[status] += 1
            out.codes[code or str(status)] += 1
            if status >= 500 and len(out.server_errors) < 10:
                out.server_errors.append(
                    {
                        "status": status,
                        "body": data[:300].decode(errors="replace"),
                        "request": body[:300].decode(errors="replace"),
                    }
                )
            if valid and status != 200 and len(out.valid_failed) < 10:
                out.valid_failed.append({"status": status, "body": data[:300].decode(errors="replace")})
    sock.close()


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _start_daemon() -> DaemonProcess:
    """The tiny model (inline on the loop) and a two-input model on two worker threads."""
    from edged.tools.demo import make_tiny_mlp
    from tests.helpers import DaemonProcess, write_config

    tmp = Path(tempfile.mkdtemp(prefix="edged-fuzz-"))
    make_tiny_mlp(tmp / "tiny.onnx")
    _two_inputs(tmp / "pair.onnx")
    cfg = write_config(
        tmp / "edged.toml",
        {
            "server": {"socket": str(tmp / "edged.sock"), "inline_threshold_us": 1_000_000},
            "cache": {"dir": str(tmp / "cache")},
            "lifecycle": {"watch_files": False},
            "models.tiny": {"path": str(tmp / "tiny.onnx"), "backend": "onnxruntime", "threads": 1},
            "models.pair": {"path": str(tmp / "pair.onnx"), "backend": "onnxruntime", "threads": 1, "instances": 2},
        },
    )
    return DaemonProcess(cfg, tmp / "edged.sock", tmp / "edged.log").start()


def _run_workers(addr: str, cases: int, workers: int, seed: int) -> Results:
    out = Results()
    threads = [
        threading.Thread(target=worker, args=(addr, seed * 1000 + i, cases // workers, out)) for i in range(workers)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def run(cases: int, workers: int, seed: int) -> dict[str, Any]:
    daemon = _start_daemon()
    assert daemon.proc is not None
    region = ShmRegion("fuzz", REGION_BYTES)
    prober = _start_prober(str(daemon.socket))
    try:
        with Client(str(daemon.socket)) as c:
            c.register_shm(REGION, region.key, REGION_BYTES)
        assert prober.stdout is not None and prober.stdout.readline() == "ready\n"
        rss_before = _rss(daemon.proc.pid)
        fds_before = fuzz_fd.open_fds(daemon.proc.pid)
        out, fd_out, elapsed = _run_cases(str(daemon.socket), cases, workers, seed)
        alive = daemon.proc.poll() is None
        rss_after = _rss(daemon.proc.pid) if alive else 0
        assert prober.stdin is not None
        prober.stdin.close()
        probes, worst, stalls, p99, failed = prober.stdout.readline().split()
        with Client(str(daemon.socket)) as c:
            after_ok = c.live() and c.ready()
        fds_after = _settled(lambda: fuzz_fd.open_fds(daemon.proc.pid) if alive else 0, fds_before)
    finally:
        prober.kill()
        region.close()
        code = daemon.stop()
    return {
        "cases": out.done + out.connection_errors,
        "answered": out.done,
        "seconds": round(elapsed, 1),
        "by_status": dict(sorted(out.status.items())),
        "by_code": dict(out.codes.most_common()),
        "server_errors_5xx": sum(n for s, n in out.status.items() if s >= 500),
        "server_error_examples": out.server_errors,
        "valid_requests_failed": out.valid_failed,
        "connections_closed_by_daemon": out.connection_errors,
        "daemon_crashed": not alive,
        "daemon_exit_code": code,
        "served_after": after_ok,
        "health_checks": int(probes),
        "health_worst_ms": round(float(worst) * 1000, 1),
        "health_p99_ms": round(float(p99) * 1000, 2),
        "loop_stalls_over_1s": int(stalls),
        "health_checks_failed": int(failed),
        "descriptor_socket": fuzz_fd.summary(fd_out, fds_before, fds_after),
        "rss_before_mb": round(rss_before / 2**20, 1),
        "rss_after_mb": round(rss_after / 2**20, 1),
        "workers": workers,
        "seed": seed,
    }


def _start_prober(addr: str) -> subprocess.Popen[str]:
    """The health prober (``_PROBER``) in its own process, checking the daemon's liveness back to
    back until its stdin closes; it prints "ready" once its first check passed."""
    return subprocess.Popen(
        [sys.executable, "-c", _PROBER, addr, str(STALL_S)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )


def _run_cases(addr: str, cases: int, workers: int, seed: int) -> tuple[Results, fuzz_fd.FdResults, float]:
    """The mutated requests on ``workers`` connections and, beside them, a tenth as many cases on
    the descriptor socket; their results and the seconds they took."""
    fd_out = fuzz_fd.FdResults()
    fd_args = (addr + ".fd", addr, seed, max(1, cases // 10), fd_out)
    fd_thread = threading.Thread(target=fuzz_fd.fd_worker, args=fd_args)
    started = time.monotonic()
    fd_thread.start()
    out = _run_workers(addr, cases, workers, seed)
    fd_thread.join()
    return out, fd_out, time.monotonic() - started


def _settled(count: Callable[[], int], target: int, timeout: float = 10.0) -> int:
    """The count once it is back to ``target`` (the daemon closes connections as it reads their
    end), or its value at the deadline."""
    deadline = time.monotonic() + timeout
    n = count()
    while n > target and time.monotonic() < deadline:
        time.sleep(0.05)  # polling the daemon's descriptor table, bounded by the deadline
        n = count()
    return n


def _two_inputs(path: Path) -> None:
    """A model with two inputs (a + b), so that input lists of two are valid."""
    from onnx import TensorProto, helper

    from edged.tools.demo import save_graph

    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["sum"])],
        "pair",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", 8]) for n in ("a", "b")],
        [helper.make_tensor_value_info("sum", TensorProto.FLOAT, ["N", 8])],
    )
    save_graph(graph, path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=100_000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "fuzz.json")
    ap.add_argument("--no-hostile", action="store_true", help="skip the hostile peers (bench/hostile.py)")
    args = ap.parse_args(argv)
    result = run(args.cases, args.workers, args.seed) if args.cases else _nothing()
    if not args.no_hostile:
        from bench import hostile

        result["hostile"] = hostile.run()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    sys.stdout.write(json.dumps(result, indent=2) + "\n")
    ok = not result["daemon_crashed"] and not result["server_errors_5xx"] and not result["loop_stalls_over_1s"]
    fds = result["descriptor_socket"]
    ok = ok and fds["daemon_fds_after"] <= fds["daemon_fds_before"] and "internal" not in fds["by_code"]
    if "hostile" in result:
        ok = ok and _hostile_ok(result["hostile"])
    sys.exit(0 if ok and not result["valid_requests_failed"] else 1)


def _nothing() -> dict[str, Any]:
    """The figures of a run of no mutated requests (``--cases 0``: the hostile peers alone)."""
    return {
        "cases": 0,
        "daemon_crashed": False,
        "server_errors_5xx": 0,
        "loop_stalls_over_1s": 0,
        "valid_requests_failed": 0,
        "descriptor_socket": {"daemon_fds_after": 0, "daemon_fds_before": 0, "by_code": {}},
    }


def _hostile_ok(h: dict[str, Any]) -> bool:
    """No other peer's request failed, no health check failed or waited a second, edged serves."""
    cases = [h[k] for k in ("connections", "gzip", "bytes", "mqtt")]
    fine = all(c["health_failed"] == 0 and c["health_worst_ms"] < 1000 for c in cases)
    return fine and h["connections"]["other_peer_failed"] == 0 and all(h["served_after"].values())


if __name__ == "__main__":
    main()
