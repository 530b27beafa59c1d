"""Hostile requests against a real daemon: each is refused (or served) with a 4xx or a result,
and a health prober in its own process is answered throughout. Checked on the event loop, the
first two would freeze it for seconds (40,000 input names 11 s, one output listed 480,000 times
3.2 s, where measured); run on the loop, a 2M-row request to an inline model would hold it for the
whole run (0.3 s there), so that one is held to a fraction of the run's own time."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest

from edged.client import Client
from tests.helpers import FREEZE_S, DaemonProcess, HealthProber, write_config

pytestmark = pytest.mark.integration


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
    assert prober.worst < FREEZE_S, f"a health check waited {prober.worst * 1000:.0f} ms"


def test_one_output_listed_480000_times(served: DaemonProcess) -> None:
    x = {"name": "x", "shape": [1, 16], "datatype": "FP32", "data": [0.0] * 16}
    body = orjson.dumps({"inputs": [x], "outputs": [{"name": "probs"}] * 480_000})
    assert len(body) > 8_000_000
    with HealthProber(served.socket).running() as prober:
        status, data = post(served.socket, "/v2/models/tiny/infer", body, {})
    assert status == 400 and orjson.loads(data)["code"] == "invalid_input", data[:300]
    assert prober.worst < FREEZE_S, f"a health check waited {prober.worst * 1000:.0f} ms"


def compute_infer_s(d: DaemonProcess, model: str) -> float:
    """The seconds the model's runs have taken so far, as the daemon's statistics count them."""
    with d.client() as c:
        status, data, _ = c.request("GET", f"/v2/models/{model}/stats")
    assert status == 200, data
    return float(orjson.loads(data)["model_stats"][0]["inference_stats"]["compute_infer"]["ns"]) / 1e9


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
    before = compute_infer_s(served, "tiny")
    with HealthProber(served.socket).running() as prober:
        status, data = post(served.socket, "/v2/models/tiny/infer", header + x.tobytes(), headers)
    assert status == 200, data[:300]
    assert len(data) > rows * 4 * 4  # the binary probabilities came back
    # Run on the loop, the run would hold a health check for as long as it took: the slowest
    # answer is held to half the run's own time (two figures of this run, whatever the machine).
    run_s = compute_infer_s(served, "tiny") - before
    assert prober.worst < min(run_s / 2, FREEZE_S), (
        f"a health check waited {prober.worst * 1000:.0f} ms during a run of {run_s * 1000:.0f} ms"
    )
    print(f"\nslowest health check {prober.worst * 1000:.1f} ms during a run of {run_s * 1000:.0f} ms")
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
