"""The Open Inference Protocol over the Unix socket, against a real daemon running ONNX Runtime."""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import orjson
import pytest

from edged import errors
from edged.client import Client
from tests.helpers import DaemonProcess, raw_http

pytestmark = pytest.mark.integration


def reference(model: Path, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


raw = raw_http


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[DaemonProcess]:
    """One daemon for the read-mostly tests of this module: tiny, a lazy twin, a deferred one."""
    from tests.helpers import DaemonProcess, write_config

    tmp = tmp_path_factory.mktemp("api")
    cfg = write_config(
        tmp / "edged.toml",
        {
            "server": {"socket": str(tmp / "edged.sock"), "max_body": "1MiB"},
            "cache": {"dir": str(tmp / "cache")},
            "build": {"block_ready": True},
            "models.tiny": {"path": str(model_dir / "tiny.onnx"), "backend": "onnxruntime"},
            "models.lazy": {"path": str(model_dir / "tiny_b.onnx"), "preload": "lazy"},
            "models.broken": {"path": str(tmp / "missing.onnx")},
        },
    )
    d = DaemonProcess(cfg, tmp / "edged.sock", tmp / "edged.log").start()
    yield d
    assert d.stop() == 0, d.log()


def test_health_and_metadata(served: DaemonProcess) -> None:
    status, body, _ = raw(served.socket, "GET", "/v2/health/live")
    assert status == 200 and orjson.loads(body)["live"] is True
    status, body, _ = raw(served.socket, "GET", "/v2/health/ready")
    assert status == 200 and orjson.loads(body)["ready"] is True
    meta = orjson.loads(raw(served.socket, "GET", "/v2")[1])
    assert meta["name"] == "edged" and "system_shared_memory" in meta["extensions"]
    model = orjson.loads(raw(served.socket, "GET", "/v2/models/tiny")[1])
    assert model["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 16]}]
    assert model["outputs"][0]["name"] == "probs"
    assert raw(served.socket, "GET", "/v2/models/tiny/ready")[0] == 200
    # The daemon warmed the whole request path before READY, and every warm-up request succeeded.
    assert "warm-up request answered" not in served.log()


def test_json_infer_matches_onnxruntime(served: DaemonProcess, model_dir: Path) -> None:
    x = np.arange(32, dtype=np.float32).reshape(2, 16) / 10
    body = orjson.dumps(
        {"id": "r1", "inputs": [{"name": "x", "shape": [2, 16], "datatype": "FP32", "data": x.ravel().tolist()}]}
    )
    status, data, _ = raw(served.socket, "POST", "/v2/models/tiny/infer", body)
    assert status == 200, data
    doc = orjson.loads(data)
    assert doc["id"] == "r1" and doc["model_name"] == "tiny"
    out = doc["outputs"][0]
    assert out["shape"] == [2, 4] and out["datatype"] == "FP32"
    np.testing.assert_allclose(
        np.array(out["data"]).reshape(2, 4), reference(model_dir / "tiny.onnx", x), rtol=1e-5, atol=1e-6
    )


def test_binary_infer_with_client(served: DaemonProcess, model_dir: Path) -> None:
    x = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
    with served.client() as c:
        out = c.infer("tiny", {"x": x})
    np.testing.assert_allclose(out["probs"], reference(model_dir / "tiny.onnx", x), rtol=1e-5, atol=1e-6)


def test_shared_memory_input_and_output(served: DaemonProcess, model_dir: Path) -> None:
    x = np.random.default_rng(2).standard_normal((1, 16)).astype(np.float32)
    with served.client() as c:
        out = c.infer_shm("tiny", {"x": x})
        np.testing.assert_allclose(out["probs"], reference(model_dir / "tiny.onnx", x), rtol=1e-5)
        # The region is reused, not re-registered, for the next frame; its name is unique to
        # this client ({model}.{input}.{pid}.{random}) so other programs never collide with it.
        regions = c.shm_status()
        assert len(regions) == 1 and regions[0]["name"].startswith(f"tiny.x.{os.getpid()}.")
        out2 = c.infer_shm("tiny", {"x": x * 2})
        assert c.shm_status() == regions
        np.testing.assert_allclose(out2["probs"], reference(model_dir / "tiny.onnx", x * 2), rtol=1e-5)
        # Output into a region too (Triton's parameters on the output).
        region = c.shm_region("out", 64)
        body = orjson.dumps(
            {
                "inputs": [region_input(c, x)],
                "outputs": [
                    {"name": "probs", "parameters": {"shared_memory_region": "out", "shared_memory_byte_size": 64}}
                ],
            }
        )
        status, data, _ = c.request("POST", "/v2/models/tiny/infer", body)
        assert status == 200, data
        assert orjson.loads(data)["outputs"][0]["parameters"]["shared_memory_byte_size"] == 16
        np.testing.assert_allclose(region.read(np.float32, (1, 4)), out["probs"], rtol=1e-6)
    with served.client() as c:
        assert c.shm_status() == []  # close() unregistered everything


def region_input(c: Client, x: np.ndarray) -> dict[str, object]:
    return c.shm_region("in", x.nbytes).put(x).meta("x")


@pytest.mark.parametrize(
    ("body", "status", "code", "needle"),
    [
        (b"{not json", 400, "bad_request", "malformed JSON"),
        (orjson.dumps({"inputs": []}), 400, "bad_request", "'inputs' must be a non-empty list"),
        (
            orjson.dumps({"inputs": [{"name": "y", "shape": [1, 16], "datatype": "FP32", "data": [0] * 16}]}),
            400,
            "invalid_input",
            "takes inputs [x]",
        ),
        (
            orjson.dumps({"inputs": [{"name": "x", "shape": [1, 16], "datatype": "INT32", "data": [0] * 16}]}),
            400,
            "invalid_input",
            "expected datatype FP32",
        ),
        (
            orjson.dumps({"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32", "data": [0] * 8}]}),
            400,
            "invalid_input",
            "expected shape [-1, 16]",
        ),
        (
            orjson.dumps({"inputs": [{"name": "x", "shape": [1, 16], "datatype": "FP32", "data": [0] * 15}]}),
            400,
            "bad_request",
            "needs 16 values",
        ),
        (
            orjson.dumps(
                {
                    "inputs": [
                        {
                            "name": "x",
                            "shape": [1, 16],
                            "datatype": "FP32",
                            "parameters": {"shared_memory_region": "nope", "shared_memory_byte_size": 64},
                        }
                    ]
                }
            ),
            400,
            "shm_region_not_found",
            "'nope' is not registered",
        ),
    ],
)
def test_bad_input_is_a_precise_error(served: DaemonProcess, body: bytes, status: int, code: str, needle: str) -> None:
    got, data, _ = raw(served.socket, "POST", "/v2/models/tiny/infer", body)
    doc = orjson.loads(data)
    assert (got, doc["code"]) == (status, code), doc
    assert needle in doc["error"]
    # ... and the daemon keeps serving everyone else.
    with served.client() as c:
        assert c.infer("tiny", {"x": np.zeros((1, 16), np.float32)})["probs"].shape == (1, 4)


def test_binary_size_mismatch_and_body_limit(served: DaemonProcess) -> None:
    header = orjson.dumps(
        {"inputs": [{"name": "x", "shape": [1, 16], "datatype": "FP32", "parameters": {"binary_data_size": 64}}]}
    )
    status, data, _ = raw(
        served.socket,
        "POST",
        "/v2/models/tiny/infer",
        header + b"\0" * 60,
        {"Inference-Header-Content-Length": str(len(header))},
    )
    assert status == 400 and b"runs past the end" in data
    status, data, _ = raw(served.socket, "POST", "/v2/models/tiny/infer", b"x" * (2 << 20))
    assert status == 413 and orjson.loads(data)["code"] == "payload_too_large"


def test_unknown_and_unavailable_models(served: DaemonProcess) -> None:
    status, data, _ = raw(served.socket, "POST", "/v2/models/nope/infer", b"{}")
    assert status == 404 and orjson.loads(data)["code"] == "model_not_found"
    with served.client() as c, pytest.raises(errors.ModelNotReadyError, match="does not exist"):
        c.infer("broken", {"x": np.zeros((1, 16), np.float32)})
    assert raw(served.socket, "GET", "/v2/models/broken/ready")[0] == 503


def test_shm_region_errors(served: DaemonProcess) -> None:
    with served.client() as c:
        with pytest.raises(errors.SharedMemoryNotFoundError, match="does not exist"):
            c.register_shm("r", "/edged-test-no-such-key", 64)
        region = c.shm_region("small", 16)
        body = orjson.dumps(
            {
                "inputs": [
                    {
                        "name": "x",
                        "shape": [1, 16],
                        "datatype": "FP32",
                        "parameters": {"shared_memory_region": "small", "shared_memory_byte_size": 64},
                    }
                ]
            }
        )
        status, data, _ = c.request("POST", "/v2/models/tiny/infer", body)
        assert status == 400 and b"too small" in data
        assert region.byte_size == 16


def test_lazy_model_loads_on_first_request_and_repository(served: DaemonProcess) -> None:
    with served.client() as c:
        index = {m["name"]: m for m in c.repository_index()}
        assert index["lazy"]["state"] == "LAZY" and index["tiny"]["state"] == "READY"
        assert index["broken"]["state"] == "FAILED"
        out = c.infer("lazy", {"x": np.ones((1, 16), np.float32)})
        assert out["probs"].shape == (1, 4)
        assert c.model_ready("lazy")
        c.unload("lazy")
        assert not c.model_ready("lazy")
        c.load("lazy")
        assert c.model_ready("lazy")


def test_status_and_metrics(served: DaemonProcess) -> None:
    with served.client() as c:
        c.infer("tiny", {"x": np.zeros((1, 16), np.float32)})
        st = c.status()
    assert st["ready"] is True
    assert st["models"]["tiny"]["state"] == "ready"
    assert st["models"]["tiny"]["footprint_measured"] is True
    assert st["memory"]["budget_bytes"] > 0 and st["memory"]["source"] in ("meminfo", "nvml", "jtop")
    assert "broken" in st["models"] and st["models"]["broken"]["state"] == "failed"
    status, data, _ = raw(served.socket, "GET", "/metrics")
    assert status == 200
    assert b'edged_requests_total{model="tiny",outcome="ok",transport="http"}' in data


def test_concurrent_clients(served: DaemonProcess, model_dir: Path) -> None:
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((1, 16)).astype(np.float32) for _ in range(8)]
    want = [reference(model_dir / "tiny.onnx", x) for x in xs]
    failures: list[str] = []

    def worker(i: int) -> None:
        with served.client() as c:
            for _ in range(50):
                out = c.infer("tiny", {"x": xs[i]})["probs"]
                if not np.allclose(out, want[i], rtol=1e-5, atol=1e-6):
                    failures.append(f"client {i} got a wrong answer")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures
    assert not any(t.is_alive() for t in threads)


def test_socket_permissions_and_second_daemon_refused(
    served: DaemonProcess, daemon_factory: Callable[..., DaemonProcess], model_dir: Path
) -> None:
    mode = stat.S_IMODE(os.stat(served.socket).st_mode)
    assert mode == 0o660
    second = daemon_factory({"tiny": {"path": str(model_dir / "tiny.onnx")}}, name="second")
    # Point the second daemon at the first one's socket.
    second.config.write_text(second.config.read_text().replace(str(second.socket), str(served.socket)))
    second.start(wait_ready=False)
    assert second.proc is not None
    assert second.proc.wait(60) == 1
    assert "already serving" in second.log()
    with served.client() as c:
        assert c.ready()  # the live socket was not stolen
