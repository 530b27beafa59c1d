"""Request bodies in flight share one budget (server.bodies_in_flight), on a real daemon: eight
concurrent gzip bodies that each inflate to max_body raise the daemon's peak resident memory by a
bound derived from the budget, not eight times max_body, and the memory goes back afterwards."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from edged.client import Client
from tests.helpers import DaemonProcess, wait_for

pytestmark = pytest.mark.integration

MAX_BODY = 64 << 20
BUDGET = 128 << 20


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field}")


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM back to the current VmRSS


def bomb() -> bytes:
    """An infer body whose padding inflates it to max_body (less a little): 64 KiB sent."""
    head = orjson.dumps({"inputs": [{"name": "x", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}]})
    pad = MAX_BODY - len(head) - 64
    return gzip.compress(head[:-1] + b', "pad": "' + b"0" * pad + b'"}', compresslevel=9)


def test_concurrent_gzip_bodies_are_bounded_by_the_budget(
    daemon_factory: Callable[..., DaemonProcess], model_dir: Path
) -> None:
    d = daemon_factory(
        {"tiny": {"path": str(model_dir / "tiny.onnx")}},
        extra={"server": {"max_body": str(MAX_BODY), "bodies_in_flight": str(BUDGET), "max_json": "128MiB"}},
    ).start()
    assert d.proc is not None
    pid = d.proc.pid
    body = bomb()
    assert len(body) < 1 << 20
    with d.client() as c:
        c.live()
    rest = status_kib(pid, "VmRSS")
    reset_peak(pid)
    answers: list[tuple[int, str]] = []
    lock = threading.Lock()
    go = threading.Barrier(8)

    def send() -> None:
        with Client(str(d.socket), timeout=60) as c:
            go.wait()
            status, data, _ = c.request(
                "POST", "/v2/models/tiny/infer", body, {"Content-Type": "application/json", "Content-Encoding": "gzip"}
            )
        with lock:
            answers.append((status, str(orjson.loads(data).get("code", "ok"))))

    threads = [threading.Thread(target=send) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(answers) == 8, answers
    peak = status_kib(pid, "VmHWM") - rest
    # Each body is refused (503 body_budget) or read whole (then answered: 200, or a 4xx for its
    # padding); nothing else, and never a dead daemon.
    assert {s for s, _ in answers} <= {200, 400, 413, 503}, answers
    assert all(code == "body_budget" for s, code in answers if s == 503), answers
    # Within the budget, the inflation's steps held beside the body while it is assembled, and
    # the decoder's work: three budgets. Eight bodies each inflated would be 8 x 64 MiB at least.
    assert peak < 3 * BUDGET, f"peak RSS grew {peak >> 20} MiB (budget {BUDGET >> 20} MiB): {answers}"
    with d.client() as c:
        assert c.live()
        assert wait_for(lambda: status_kib(pid, "VmRSS") - rest < BUDGET // 2, 10, what="the bodies' memory back")
