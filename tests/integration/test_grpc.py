"""Triton's own gRPC client (tritonclient.grpc) against a real daemon: the gRPC Unix socket
beside the HTTP one, and a TCP listener guarded by the bearer token."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tritongrpc
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from tests.helpers import DaemonProcess, write_config
from tests.integration.test_listeners import free_port
from tests.repository import reference

pytestmark = pytest.mark.integration

TOKEN = "grpc-test-token-0123456789"


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
            "models.strings": {"path": str(model_dir / "strings.onnx")},
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


def test_forks_run_none_of_grpcs_handlers(served: tuple[DaemonProcess, Path, int]) -> None:
    """The daemon forked its build child while grpcio served (block_ready builds before READY=1):
    gRPC core's fork handlers, which can hold the forking event loop, are off (its fork_posix
    log line, written at every fork while they are on, is absent)."""
    d = served[0]
    assert "tiny: built" in d.log(), "no build child was started"
    assert "fork_posix" not in d.log(), d.log()


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
    assert "Request for unknown model: 'nope' is not found" in e.value.message()


@pytest.fixture
def tcp(served: tuple[DaemonProcess, Path, int]) -> Iterator[tritongrpc.InferenceServerClient]:
    c = tritongrpc.InferenceServerClient(url=f"127.0.0.1:{served[2]}")
    yield c
    c.close()


AUTH = {"authorization": f"Bearer {TOKEN}"}


def test_tcp_needs_the_token(tcp: tritongrpc.InferenceServerClient, model_dir: Path) -> None:
    with pytest.raises(InferenceServerException) as e:
        tcp.is_server_live()
    assert e.value.status() == "StatusCode.UNAUTHENTICATED"
    with pytest.raises(InferenceServerException):
        tcp.is_server_live(headers={"authorization": "Bearer wrong-token-0123456789"})
    assert tcp.is_server_live(headers=AUTH) and tcp.is_model_ready("tiny", headers=AUTH)
    x = np.ones((1, 16), np.float32)
    np.testing.assert_allclose(_infer(tcp, x, headers=AUTH), reference(model_dir / "tiny.onnx", x), rtol=1e-5)
    # Shared memory is for local clients on the Unix socket only, as on HTTP.
    with pytest.raises(InferenceServerException) as e:
        tcp.register_system_shared_memory("r", "/edged_grpc_tcp", 64, headers=AUTH)
    assert "only available to local clients" in e.value.message()
    assert tcp.get_system_shared_memory_status(headers=AUTH).regions == {}


def test_control_rpcs_answer_as_http_does(unix: tritongrpc.InferenceServerClient) -> None:
    cfg = unix.get_model_config("tiny").config
    assert cfg.name == "tiny" and cfg.platform == "onnxruntime_onnx" and cfg.input[0].name == "x"
    _infer(unix, np.zeros((1, 16), np.float32))
    stats = unix.get_inference_statistics("tiny").model_stats[0]
    assert stats.name == "tiny" and stats.inference_stats.success.count >= 1
    index = {m.name: m.state for m in unix.get_model_repository_index().models}
    assert index["tiny"] == "READY"
    unix.unload_model("strings")
    assert not unix.is_model_ready("strings")
    unix.load_model("strings")
    assert unix.is_model_ready("strings")
    with pytest.raises(InferenceServerException) as e:
        unix.load_model("strings", config='{"backend": "onnxruntime"}')
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT" and "edged serves none" in e.value.message()
    settings = unix.get_log_settings(as_json=True)["settings"]
    assert settings["log_info"]["bool_param"] is True
    with pytest.raises(InferenceServerException) as e:
        unix.update_log_settings({"log_format": "ISO8601"})
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    trace = unix.get_trace_settings(as_json=True)["settings"]
    assert trace["trace_level"]["value"] == ["OFF"]
    with pytest.raises(InferenceServerException):
        unix.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]})
    assert unix.get_cuda_shared_memory_status().regions == {}
    unix.unregister_cuda_shared_memory()
    with pytest.raises(InferenceServerException) as e:
        unix.register_cuda_shared_memory("c", b"aGFuZGxl", 0, 64)
    assert e.value.status() == "StatusCode.UNIMPLEMENTED" and "not supported" in e.value.message()


def test_bytes_tensors(unix: tritongrpc.InferenceServerClient) -> None:
    text = tritongrpc.InferInput("text", [2], "BYTES")
    text.set_data_from_numpy(np.array([b"hi", b"edged"], dtype=object))
    x = tritongrpc.InferInput("x", [2, 2], "FP32")
    x.set_data_from_numpy(np.ones((2, 2), np.float32))
    out = unix.infer("strings", [text, x])
    shout = out.as_numpy("shout")
    assert shout is not None and list(shout) == [b"hi!", b"edged!"]


def test_system_shared_memory_over_the_unix_socket(unix: tritongrpc.InferenceServerClient, model_dir: Path) -> None:
    x = np.random.default_rng(1).standard_normal((1, 16)).astype(np.float32)
    in_handle = shm.create_shared_memory_region("in", "/edged_grpc_in", x.nbytes)
    out_handle = shm.create_shared_memory_region("out", "/edged_grpc_out", 16)
    try:
        shm.set_shared_memory_region(in_handle, [x])
        unix.register_system_shared_memory("in", "/edged_grpc_in", x.nbytes)
        unix.register_system_shared_memory("out", "/edged_grpc_out", 16)
        assert set(unix.get_system_shared_memory_status().regions) == {"in", "out"}
        inp = tritongrpc.InferInput("x", [1, 16], "FP32")
        inp.set_shared_memory("in", x.nbytes)
        want = tritongrpc.InferRequestedOutput("probs")
        want.set_shared_memory("out", 16)
        unix.infer("tiny", [inp], outputs=[want])
        got = shm.get_contents_as_numpy(out_handle, np.float32, [1, 4])
        np.testing.assert_allclose(got, reference(model_dir / "tiny.onnx", x), rtol=1e-5)
        unix.unregister_system_shared_memory("in")
        assert set(unix.get_system_shared_memory_status().regions) == {"out"}
    finally:
        unix.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(in_handle)
        shm.destroy_shared_memory_region(out_handle)
    assert unix.get_system_shared_memory_status().regions == {}


def test_a_stream_answers_each_request_of_a_plain_model(unix: tritongrpc.InferenceServerClient) -> None:
    got: queue.Queue[tuple[object, object]] = queue.Queue()
    unix.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        for i, shape in enumerate([(1, 16), (1, 3), (2, 16)]):
            inp = tritongrpc.InferInput("x", list(shape), "FP32")
            inp.set_data_from_numpy(np.zeros(shape, np.float32))
            unix.async_stream_infer("tiny", [inp], request_id=str(i))
        answers = [got.get(timeout=30) for _ in range(3)]
    finally:
        unix.stop_stream()
    first, second, third = answers
    assert first[1] is None and first[0].as_numpy("probs").shape == (1, 4)  # type: ignore[attr-defined]
    assert second[0] is None and "expected shape [-1, 16], got [1, 3]" in str(second[1])
    assert third[1] is None and third[0].as_numpy("probs").shape == (2, 4)  # type: ignore[attr-defined]
