"""Hostile requests against a real daemon: each is refused (or served) with a 4xx or a result,
and a concurrent health check stays fast while it runs. Before the fixes these froze the event
loop: 40,000 input names 11 s, one output listed 480,000 times 3.2 s, a 2M-row request to an
inline model 0.3 s."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest

from edged.client import Client
from tests.helpers import DaemonProcess, write_config

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration

STALL_LIMIT_S = 0.1


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[DaemonProcess]:
    tmp = tmp_path_factory.mktemp("hostile")
    cfg = write_config(
        tmp / "edged.toml",
        {
            # The tiny model runs inline on the loop whatever this machine's load measures.
            "server": {"socket": str(tmp / "edged.sock"), "inline_threshold_us": 1_000_000},
            "cache": {"dir": str(tmp / "cache")},
            "models.tiny": {"path": str(model_dir / "tiny.onnx"), "backend": "onnxruntime"},
        },
    )
    d = DaemonProcess(cfg, tmp / "edged.sock", tmp / "edged.log").start()
    with d.client() as c:
        assert c.status()["models"]["tiny"]["inline"], "the test needs tiny to run inline"
    yield d
    assert d.stop() == 0, d.log()


_PROBER = """
import select, sys, time
from edged.client import Client
worst, count = 0.0, 0
with Client(sys.argv[1], timeout=60) as c:
    for _ in range(3):  # the connection's set-up is not what is measured
        assert c.live()
    print("ready", flush=True)
    while not select.select([sys.stdin], [], [], 0)[0]:  # until the test closes our stdin
        t0 = time.perf_counter()
        assert c.live()
        worst = max(worst, time.perf_counter() - t0)
        count += 1
print(count, worst, flush=True)
"""


class HealthProber:
    """Asks /v2/health/live back to back over its own connection, from its own process (so the
    test's own work cannot delay it), and keeps the slowest answer."""

    def __init__(self, sock: Path) -> None:
        self.sock = sock
        self.worst = 0.0
        self.count = 0

    @contextlib.contextmanager
    def running(self) -> Iterator[HealthProber]:
        proc = subprocess.Popen(
            [sys.executable, "-c", _PROBER, str(self.sock)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        assert proc.stdin is not None and proc.stdout is not None
        try:
            assert proc.stdout.readline() == "ready\n", "the health prober did not start"
            yield self
            proc.stdin.close()
            line = proc.stdout.readline()
            assert line, "the health prober failed: a health check timed out (60 s) during the hostile request"
            count, worst = line.split()
            self.count, self.worst = int(count), float(worst)
            assert proc.wait(30) == 0
        finally:
            proc.kill()
            proc.wait(30)
        assert self.count > 0, "no health check ran during the hostile request"


def post(sock: Path, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    with Client(str(sock), timeout=120) as c:
        status, data, _ = c.request("POST", path, body, {"Content-Type": "application/json", **(headers or {})})
    return status, data


def _names(n: int) -> list[dict[str, object]]:
    return [{"name": f"input_{i:05d}", "shape": [1], "datatype": "FP32", "data": [0.0]} for i in range(n)]


def test_40000_input_names(served: DaemonProcess) -> None:
    body = orjson.dumps({"inputs": _names(40_000)})
    assert len(body) > 2_000_000
    with HealthProber(served.socket).running() as prober:
        status, data = post(served.socket, "/v2/models/tiny/infer", body)
    assert status == 400 and orjson.loads(data)["code"] == "invalid_input", data[:300]
    assert prober.worst < STALL_LIMIT_S, f"health check took {prober.worst * 1000:.0f} ms"


def test_one_output_listed_480000_times(served: DaemonProcess) -> None:
    x = {"name": "x", "shape": [1, 16], "datatype": "FP32", "data": [0.0] * 16}
    body = orjson.dumps({"inputs": [x], "outputs": [{"name": "probs"}] * 480_000})
    assert len(body) > 8_000_000
    with HealthProber(served.socket).running() as prober:
        status, data = post(served.socket, "/v2/models/tiny/infer", body, {})
    assert status == 400 and orjson.loads(data)["code"] == "invalid_input", data[:300]
    assert prober.worst < STALL_LIMIT_S, f"health check took {prober.worst * 1000:.0f} ms"


def test_2m_row_request_to_an_inline_model_runs_off_the_loop(served: DaemonProcess) -> None:
    rows = 2_000_000
    x = np.random.default_rng(0).random((rows, 16), dtype=np.float32)
    header = orjson.dumps(
        {
            "inputs": [
                {"name": "x", "shape": [rows, 16], "datatype": "FP32", "parameters": {"binary_data_size": x.nbytes}}
            ],
            "parameters": {"binary_data_output": True},
        }
    )
    headers = {"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"}
    with HealthProber(served.socket).running() as prober:
        status, data = post(served.socket, "/v2/models/tiny/infer", header + x.tobytes(), headers)
    assert status == 200, data[:300]
    assert len(data) > rows * 4 * 4  # the binary probabilities came back
    assert prober.worst < STALL_LIMIT_S, f"health check took {prober.worst * 1000:.0f} ms"
    # Small requests still run inline and give the right answer afterwards.
    with served.client() as c:
        out = c.infer("tiny", {"x": x[:1]})
    assert out["probs"].shape == (1, 4)
    np.testing.assert_allclose(out["probs"].sum(), 1.0, rtol=1e-5)


@pytest.mark.parametrize("value", ["+16", "1_6", "0x10", "16.0", "-16", "1" * 40])
def test_header_length_is_parsed_strictly(served: DaemonProcess, value: str) -> None:
    x = np.zeros((1, 16), np.float32)
    header = orjson.dumps(
        {"inputs": [{"name": "x", "shape": [1, 16], "datatype": "FP32", "parameters": {"binary_data_size": 64}}]}
    )
    status, data = post(
        served.socket, "/v2/models/tiny/infer", header + x.tobytes(), {"Inference-Header-Content-Length": value}
    )
    assert status == 400, (value, data)
    assert orjson.loads(data)["code"] == "bad_request"
    assert b"decimal integer" in data


def test_unknown_model_is_404_whatever_the_body(served: DaemonProcess) -> None:
    status, data = post(served.socket, "/v2/models/nope/infer", orjson.dumps({"inputs": []}))
    assert status == 404 and orjson.loads(data)["code"] == "model_not_found"
