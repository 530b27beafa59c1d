"""Triton's own gRPC client (tritonclient.grpc) against a real daemon: the gRPC Unix socket
beside the HTTP one, and a TCP listener guarded by the bearer token."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as tritongrpc
from tritonclient.utils import InferenceServerException

from tests.helpers import DaemonProcess, write_config

pytestmark = pytest.mark.integration

TOKEN = "grpc-test-token-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def reference(model: Path, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    out: np.ndarray = sess.run(None, {"x": x})[0]
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[tuple[DaemonProcess, Path, int]]:
    tmp = tmp_path_factory.mktemp("grpc")
    port = free_port()
    token = tmp / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    cfg = write_config(
        tmp / "edged.toml",
        {
            "server": {
                "socket": str(tmp / "edged.sock"),
                "grpc_tcp": [f"127.0.0.1:{port}"],
                "tcp_token_file": str(token),
            },
            "cache": {"dir": str(tmp / "cache")},
            "build": {"block_ready": True},
            "models.tiny": {"path": str(model_dir / "tiny.onnx")},
        },
    )
    d = DaemonProcess(cfg, tmp / "edged.sock", tmp / "edged.log").start()
    yield d, tmp / "edged.sock.grpc", port
    assert d.stop() == 0, d.log()


@pytest.fixture
def unix(served: tuple[DaemonProcess, Path, int]) -> Iterator[tritongrpc.InferenceServerClient]:
    c = tritongrpc.InferenceServerClient(url=f"unix:{served[1]}")
    yield c
    c.close()


def _infer(c: tritongrpc.InferenceServerClient, x: np.ndarray, **kw: object) -> np.ndarray:
    inp = tritongrpc.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    out = c.infer("tiny", [inp], **kw).as_numpy("probs")  # type: ignore[arg-type]
    assert out is not None
    return out


def test_health_metadata_and_infer_over_the_unix_socket(
    unix: tritongrpc.InferenceServerClient, served: tuple[DaemonProcess, Path, int], model_dir: Path
) -> None:
    assert served[1].exists()
    assert oct(served[1].stat().st_mode & 0o777) == oct(served[0].socket.stat().st_mode & 0o777)
    assert unix.is_server_live() and unix.is_server_ready() and unix.is_model_ready("tiny")
    meta = unix.get_server_metadata()
    assert meta.name == "edged" and "system_shared_memory" in meta.extensions
    model = unix.get_model_metadata("tiny")
    assert [i.name for i in model.inputs] == ["x"] and model.inputs[0].datatype == "FP32"
    x = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)
    np.testing.assert_allclose(_infer(unix, x), reference(model_dir / "tiny.onnx", x), rtol=1e-5)


def test_an_unknown_model_is_not_found_with_the_http_message(unix: tritongrpc.InferenceServerClient) -> None:
    inp = tritongrpc.InferInput("x", [1, 16], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 16), np.float32))
    with pytest.raises(InferenceServerException) as e:
        unix.infer("nope", [inp])
    assert e.value.status() == "StatusCode.NOT_FOUND"
    assert "unknown model 'nope'" in e.value.message()
