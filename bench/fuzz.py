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
import gzip
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from bench import fuzz_fd
from bench.wire import connect, http_bytes
from edged.client import Client
from edged.client.shm import ShmRegion

if TYPE_CHECKING:
    from tests.helpers import DaemonProcess

REPO = Path(__file__).resolve().parent.parent
REGION, REGION_BYTES = "fuzz", 4096
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

NASTY: list[Any] = [
    None,
    True,
    -1,
    0,
    2**31,
    2**63 - 1,
    1.5,
    "",
    "x",
    "FP32",
    [],
    [-1],
    [2**62, 2**62],
    [[]],
    {},
    {"a": 1},
    "\u0000",
    "😀" * 3,
]
KEYS = ["name", "shape", "datatype", "data", "parameters", "inputs", "outputs", "id", "binary_data_size"]
PARAM_KEYS = [
    "binary_data_size",
    "binary_data",
    "binary_data_output",
    "shared_memory_region",
    "shared_memory_byte_size",
    "shared_memory_offset",
]
HEADER_LENGTHS = ["+{n}", " {n}", "{n} ", "{n}_0", "0x{n}", "-{n}", "{n}.0", "1" * 40, "", "٣"]


def _valid(rng: random.Random) -> tuple[str, dict[str, Any], bytes]:
    """A valid request (model, JSON header document, binary tail) to mutate."""
    rows = rng.choice([1, 1, 2, 5])
    kind = rng.choice(["json", "binary", "shm", "pair"])
    if kind == "pair":
        a, b = np.ones((rows, 8), np.float32), np.ones((rows, 8), np.float32)
        inputs = [
            {"name": n, "shape": [rows, 8], "datatype": "FP32", "data": v.reshape(-1).tolist()}
            for n, v in [("a", a), ("b", b)]
        ]
        return "pair", {"inputs": inputs}, b""
    x = np.random.default_rng(rng.randrange(1 << 30)).random((rows, 16), dtype=np.float32)
    inp: dict[str, Any] = {"name": "x", "shape": [rows, 16], "datatype": "FP32"}
    doc: dict[str, Any] = {"id": str(rng.randrange(1000)), "inputs": [inp]}
    if rng.random() < 0.5:
        doc["outputs"] = [{"name": "probs", "parameters": {"binary_data": rng.random() < 0.5}}]
    if kind == "json":
        inp["data"] = x.reshape(-1).tolist()
        return "tiny", doc, b""
    if kind == "binary":
        inp["parameters"] = {"binary_data_size": x.nbytes}
        return "tiny", doc, x.tobytes()
    inp["parameters"] = {"shared_memory_region": REGION, "shared_memory_byte_size": x.nbytes, "shared_memory_offset": 0}
    return "tiny", doc, b""


def _mutate_doc(rng: random.Random, node: Any, depth: int = 0) -> Any:
    """One structural change somewhere in the document."""
    if isinstance(node, dict) and node and (depth < 4 and rng.random() < 0.7):
        key = rng.choice(list(node))
        node[key] = _mutate_doc(rng, node[key], depth + 1)
        return node
    if isinstance(node, list) and node and (depth < 4 and rng.random() < 0.7):
        i = rng.randrange(len(node))
        node[i] = _mutate_doc(rng, node[i], depth + 1)
        return node
    op = rng.randrange(6)
    if op == 0:
        return rng.choice(NASTY)
    if op == 1 and isinstance(node, dict):
        node.pop(rng.choice(list(node)), None) if node else None
        return node
    if op == 2 and isinstance(node, dict):
        node[rng.choice(KEYS + PARAM_KEYS)] = rng.choice([*NASTY, REGION, 64, 4096])
        return node
    if op == 3 and isinstance(node, list):
        return node + node[: rng.randrange(1, 3)]  # duplicates
    if op == 4 and isinstance(node, int) and not isinstance(node, bool):
        return node + rng.choice([-1, 1, 2**32, -(2**20)])
    return rng.choice(NASTY)


def _mutate_bytes(rng: random.Random, body: bytes) -> bytes:
    buf = bytearray(body)
    for _ in range(rng.randrange(1, 5)):
        if not buf:
            break
        at = rng.randrange(len(buf))
        op = rng.randrange(4)
        if op == 0:
            buf[at] ^= 1 << rng.randrange(8)
        elif op == 1:
            buf.insert(at, rng.choice(b'{}[]",:0-9eE.\\ \x00\xff'))
        elif op == 2:
            del buf[at]
        else:
            del buf[at:]
    return bytes(buf)


def _flood(rng: random.Random) -> tuple[str, bytes, dict[str, str]]:
    """A large hostile body: many names, one output listed many times, deep nesting."""
    x = {"name": "x", "shape": [1, 16], "datatype": "FP32", "data": [0.0] * 16}
    kind = rng.randrange(3)
    if kind == 0:
        doc: Any = {"inputs": [dict(x, name=f"n{i}") for i in range(40_000)]}
    elif kind == 1:
        doc = {"inputs": [x], "outputs": [{"name": "probs"}] * 200_000}
    else:
        return "tiny", b'{"inputs":' + b"[" * 100_000 + b"]" * 100_000 + b"}", {}
    return "tiny", orjson.dumps(doc), {}


ENCODINGS = ["gzip", "deflate", "x-gzip", "identity", "br", "gzip, gzip", "GZIP", "", "zstd"]


def _bytes_case(rng: random.Random) -> tuple[str, dict[str, Any], bytes]:
    """A BYTES tensor (length-prefixed elements, some framing broken) for a model that takes
    floats: refused before its elements are read."""
    count = rng.choice([1, 3, 1000, 100_000])
    tail = b"".join(len(e).to_bytes(4, "little") + e for e in (b"ab",) * count)
    if rng.random() < 0.5:
        tail = _mutate_bytes(rng, tail)
    params = {"binary_data_size": len(tail)}
    doc = {"inputs": [{"name": "x", "shape": [count], "datatype": "BYTES", "parameters": params}]}
    return "tiny", doc, tail


def _compress(rng: random.Random, body: bytes, valid: bool) -> tuple[bytes, dict[str, str], bool]:
    """The body compressed as the Content-Encoding header says (or says wrongly)."""
    encoding = rng.choice(ENCODINGS)
    if encoding in ("gzip", "x-gzip", "GZIP"):
        body = gzip.compress(body, 1)
    elif encoding == "deflate":
        body = zlib.compress(body, 1)
    readable = encoding in ("gzip", "x-gzip", "GZIP", "deflate", "identity", "")
    if rng.random() < 0.2:
        body, readable = _mutate_bytes(rng, body), False
    return body, {"Content-Encoding": encoding}, valid and readable


def make_case(rng: random.Random) -> tuple[str, bytes, dict[str, str], bool]:
    """(model, body, extra headers, whether the request is valid as generated)."""
    if rng.random() < 0.001:
        return (*_flood(rng), False)
    if rng.random() < 0.03:
        model, doc, tail = _bytes_case(rng)
        header = orjson.dumps(doc)
        return model, header + tail, {"Inference-Header-Content-Length": str(len(header))}, False
    model, doc, tail = _valid(rng)
    valid = rng.random() < 0.05
    if not valid:
        if rng.random() < 0.6:
            doc = _mutate_doc(rng, doc)
        elif tail and rng.random() < 0.5:
            tail = _mutate_bytes(rng, tail) if rng.random() < 0.5 else tail + os.urandom(rng.randrange(1, 64))
    header = orjson.dumps(doc)
    headers: dict[str, str] = {}
    if tail or rng.random() < 0.1:
        length = len(header)
        if not valid and rng.random() < 0.15:
            headers["Inference-Header-Content-Length"] = rng.choice(HEADER_LENGTHS).format(n=length)
        else:
            headers["Inference-Header-Content-Length"] = str(
                length + (0 if valid else rng.choice([0, 0, 1, -1, 10**6]))
            )
    body = header + tail
    if not valid and rng.random() < 0.3:
        body = _mutate_bytes(rng, body)
    if not valid and rng.random() < 0.02:
        model = rng.choice(["nope", "tiny/versions/1", "tiny/versions/2", "pair", "tiny"])
    if rng.random() < 0.1:
        body, extra, valid = _compress(rng, body, valid)
        headers.update(extra)
    return model, body, headers, valid


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
    prober = subprocess.Popen(
        [sys.executable, "-c", _PROBER, str(daemon.socket), str(STALL_S)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        with Client(str(daemon.socket)) as c:
            c.register_shm(REGION, region.key, REGION_BYTES)
        assert prober.stdout is not None and prober.stdout.readline() == "ready\n"
        rss_before = _rss(daemon.proc.pid)
        fds_before = fuzz_fd.open_fds(daemon.proc.pid)
        fd_out = fuzz_fd.FdResults()
        fd_args = (str(daemon.socket) + ".fd", str(daemon.socket), seed, max(1, cases // 10), fd_out)
        fd_thread = threading.Thread(target=fuzz_fd.fd_worker, args=fd_args)
        started = time.monotonic()
        fd_thread.start()
        out = _run_workers(str(daemon.socket), cases, workers, seed)
        fd_thread.join()
        elapsed = time.monotonic() - started
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
