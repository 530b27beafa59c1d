"""Hostile peers against one edged: what the fuzzer's mutated requests cannot do on their own.

  python -m bench fuzz                  runs these after the mutated requests (``hostile`` in fuzz.json)
  python -m bench fuzz --cases 0        these alone

Each case runs beside a health prober (its own process, /v2/health/live back to back on one
connection opened before the case) and is measured for: the daemon's peak resident growth
(VmHWM, reset before the case), the slowest health check, and, where another peer works
meanwhile, how many of its requests failed (the target is 0).

- ``connections``: one peer holds twice max_connections on the Unix socket (half silent, half
  idle keep-alive) and twice again as unauthenticated TCP connections from two loopback
  addresses, while another peer (TCP, with the token) sends requests;
- ``gzip``: eight concurrent gzip bodies of 64 KiB, each inflating to max_body (64 MiB here),
  against a budget for bodies in flight of 128 MiB;
- ``bytes``: one binary BYTES request of about 61 MiB (300,000 elements of 200 bytes) through a
  model with string inputs and outputs;
- ``mqtt``: an MQTT 5 request without an 'id' property whose 6.5 MB JSON body cannot be decoded.
"""

from __future__ import annotations

import gzip
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from edged.client import Client
from edged.wire.tensors import serialize_bytes

REPO = Path(__file__).resolve().parent.parent
TOKEN = "hostile-bench-token-0123456789"
MAX_BODY = 64 << 20
BUDGET = 128 << 20
MAX_CONNECTIONS, PER_PEER, RESERVED = 128, 32, 8
TINY = orjson.dumps({"inputs": [{"name": "x", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}]})


def _status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


@contextmanager
def _prober(sock: Path) -> Iterator[dict[str, float]]:
    """The fuzzer's health prober, for one case: its figures once the case is over."""
    from bench.fuzz import _PROBER, STALL_S

    proc = subprocess.Popen(
        [sys.executable, "-c", _PROBER, str(sock), str(STALL_S)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    figures: dict[str, float] = {}
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        yield figures
        assert proc.stdin is not None
        proc.stdin.close()
        probes, worst, _, p99, failed = proc.stdout.readline().split()
        figures.update(health_checks=int(probes), health_worst_ms=round(float(worst) * 1000, 1))
        figures.update(health_p99_ms=round(float(p99) * 1000, 2), health_failed=int(failed))
    finally:
        proc.kill()
        proc.wait(30)


def _case(pid: int, sock: Path, work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``work``'s own figures, with the peak resident growth and the health checks around it."""
    with Client(str(sock)) as c:
        c.live()
    rest = _status(pid, "VmRSS")
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM back to VmRSS: this case's peak
    started = time.perf_counter()
    with _prober(sock) as health:
        out = work()
    out["seconds"] = round(time.perf_counter() - started, 2)
    out["peak_rss_growth_mb"] = round((_status(pid, "VmHWM") - rest) / 2**20, 1)
    out.update(health)
    return out


def _tcp_infer(port: int, token: str | None) -> int:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/v2/models/tiny/infer", body=TINY, headers={"Authorization": f"Bearer {token}"})
        return conn.getresponse().status
    finally:
        conn.close()


def connections(sock: Path, port: int) -> dict[str, Any]:
    held: list[socket.socket] = []
    try:
        for i in range(2 * MAX_CONNECTIONS):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(10)
            s.connect(str(sock))
            if i % 2:
                s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")  # then idle keep-alive
            held.append(s)
        for i in range(2 * MAX_CONNECTIONS):
            held.append(socket.create_connection(("127.0.0.1", port), 10, (f"127.0.0.{2 + i % 2}", 0)))
        statuses = [_tcp_infer(port, TOKEN) for _ in range(200)]
    finally:
        for s in held:
            s.close()
    return {
        "held_unix": 2 * MAX_CONNECTIONS,
        "held_tcp_unauthenticated": 2 * MAX_CONNECTIONS,
        "other_peer_requests": len(statuses),
        "other_peer_failed": sum(s != 200 for s in statuses),
    }


def gzip_bodies(sock: Path) -> dict[str, Any]:
    head = TINY[:-1] + b', "pad": "'
    bomb = gzip.compress(head + b"0" * (MAX_BODY - len(head) - 64) + b'"}', compresslevel=9)
    codes: list[str] = []
    lock, go = threading.Lock(), threading.Barrier(8)

    def send() -> None:
        with Client(str(sock), timeout=120) as c:
            go.wait()
            status, data, _ = c.request(
                "POST", "/v2/models/tiny/infer", bomb, {"Content-Type": "application/json", "Content-Encoding": "gzip"}
            )
        with lock:
            codes.append(f"{status} {orjson.loads(data).get('code', 'ok')}")

    threads = [threading.Thread(target=send) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"bodies": 8, "sent_kb_each": len(bomb) // 1024, "inflated_mb_each": MAX_BODY >> 20, "answers": codes}


def bytes_request(sock: Path) -> dict[str, Any]:
    n, size = 300_000, 200
    raw = serialize_bytes(np.array([b"a" * size] * n, dtype=object))
    x = np.zeros((n, 2), np.float32)
    inputs = [
        {"name": "text", "shape": [n], "datatype": "BYTES", "parameters": {"binary_data_size": len(raw)}},
        {"name": "x", "shape": [n, 2], "datatype": "FP32", "parameters": {"binary_data_size": x.nbytes}},
    ]
    header = orjson.dumps({"inputs": inputs, "outputs": [{"name": "rows", "parameters": {"binary_data": True}}]})
    body = header + raw + x.tobytes()
    with Client(str(sock), timeout=600) as c:
        headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(header))}
        status, _, _ = c.request("POST", "/v2/models/strings/infer", body, headers)
    return {"request_mb": round(len(body) / 2**20, 1), "elements": n, "status": status}


def mqtt_unreadable(broker_port: int) -> dict[str, Any]:
    from tests.integration.mosquitto import Peer

    body = b'{"inputs": [{"name": "x", "shape": [1, 16], "datatype": "FP32", "data": [' + b"NaN, " * 1_300_000
    with Peer(broker_port) as p:
        p.subscribe("hostile/reply")
        p.request("edged/hostile/models/tiny/infer", body, "hostile/reply", b"u")
        reply = p.first("hostile/reply", timeout=120)
    return {"body_mb": round(len(body) / 2**20, 1), "reply": orjson.loads(reply.payload).get("code")}


def _daemon(work: Path, port: int, broker_port: int) -> Any:
    from edged.tools.demo import make_tiny_mlp
    from tests.helpers import DaemonProcess, write_config
    from tests.string_model import make_string_model

    (work / "token").write_text(TOKEN)
    (work / "token").chmod(0o600)
    server = {
        "socket": str(work / "edged.sock"),
        "tcp": [f"127.0.0.1:{port}"],
        "tcp_token_file": str(work / "token"),
        "max_body": str(MAX_BODY),
        "bodies_in_flight": str(BUDGET),
        "max_connections": MAX_CONNECTIONS,
        "max_connections_per_peer": PER_PEER,
        "reserved_connections": RESERVED,
    }
    cfg = write_config(
        work / "edged.toml",
        {
            "server": server,
            "cache": {"dir": str(work / "cache")},
            "lifecycle": {"watch_files": False},
            "mqtt": {"enabled": True, "host": "127.0.0.1", "port": broker_port, "device_id": "hostile"},
            "models.tiny": {"path": str(make_tiny_mlp(work / "tiny.onnx")), "backend": "onnxruntime"},
            "models.strings": {"path": str(make_string_model(work / "s.onnx")), "backend": "onnxruntime"},
        },
    )
    return DaemonProcess(cfg, work / "edged.sock", work / "edged.log").start()


def run() -> dict[str, Any]:
    from tests.integration.mosquitto import Broker, free_port

    work = Path(tempfile.mkdtemp(prefix="edged-hostile-"))
    broker = Broker(work / "broker")
    broker.dir.mkdir(parents=True, exist_ok=True)
    broker.start()
    port = free_port()
    daemon = _daemon(work, port, broker.port)
    try:
        pid, sock = daemon.proc.pid, daemon.socket
        out = {
            "connections": _case(pid, sock, lambda: connections(sock, port)),
            "gzip": _case(pid, sock, lambda: gzip_bodies(sock)),
            "bytes": _case(pid, sock, lambda: bytes_request(sock)),
            "mqtt": _case(pid, sock, lambda: mqtt_unreadable(broker.port)),
        }
        with Client(str(sock)) as c:
            out["served_after"] = {"live": c.live(), "ready": c.ready()}
    finally:
        code = daemon.stop()
        broker.stop()
    out["daemon_exit_code"] = code
    out["limits"] = {"max_connections": MAX_CONNECTIONS, "per_peer": PER_PEER, "reserved": RESERVED}
    out["limits"].update(max_body_mb=MAX_BODY >> 20, bodies_in_flight_mb=BUDGET >> 20)
    return out
