"""Triton's own Python client (tritonclient.http) against a real daemon's TCP listener: versions,
compressed requests and answers, system shared memory, and an unloaded model."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as tritonhttp
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from tests.bridge import Bridge
from tests.helpers import DaemonProcess, write_config

pytestmark = pytest.mark.integration


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def reference(model: Path, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    out: np.ndarray = sess.run(None, {"x": x})[0]
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[tuple[DaemonProcess, int]]:
    tmp = tmp_path_factory.mktemp("triton")
    port = free_port()
    cfg = write_config(
        tmp / "edged.toml",
        {
            "server": {"socket": str(tmp / "edged.sock"), "tcp": [f"127.0.0.1:{port}"]},
            "cache": {"dir": str(tmp / "cache")},
            "build": {"block_ready": True},
            "models.tiny": {"path": str(model_dir / "tiny.onnx")},
            "models.spare": {"path": str(model_dir / "tiny_b.onnx")},
        },
    )
    d = DaemonProcess(cfg, tmp / "edged.sock", tmp / "edged.log").start()
    yield d, port
    assert d.stop() == 0, d.log()


@pytest.fixture
def client(served: tuple[DaemonProcess, int]) -> Iterator[tritonhttp.InferenceServerClient]:
    c = tritonhttp.InferenceServerClient(url=f"127.0.0.1:{served[1]}", network_timeout=30)
    yield c
    c.close()


def test_versions(client: tritonhttp.InferenceServerClient) -> None:
    assert client.is_server_ready()
    assert client.is_model_ready("tiny") and client.is_model_ready("tiny", "1")
    assert not client.is_model_ready("tiny", "2")
    assert client.get_model_metadata("tiny", "1")["versions"] == ["1"]
    with pytest.raises(InferenceServerException) as e:
        client.get_model_metadata("tiny", "2")
    assert e.value.status() == "404" and "no version '2'" in str(e.value.message())


@pytest.mark.parametrize("request_alg", [None, "gzip", "deflate"])
@pytest.mark.parametrize("response_alg", [None, "gzip", "deflate"])
@pytest.mark.parametrize("binary", [True, False])
def test_compressed_infer(
    client: tritonhttp.InferenceServerClient,
    model_dir: Path,
    request_alg: str | None,
    response_alg: str | None,
    binary: bool,
) -> None:
    # 512 rows: a 32 kB request and an 8 kB (binary) or 20 kB (JSON) answer, above compress_min_size.
    x = np.random.default_rng(5).standard_normal((512, 16)).astype(np.float32)
    inp = tritonhttp.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    result = client.infer(
        "tiny",
        [inp],
        outputs=[tritonhttp.InferRequestedOutput("probs", binary_data=binary)],
        request_compression_algorithm=request_alg,
        response_compression_algorithm=response_alg,
    )
    got = result.as_numpy("probs")
    assert got is not None and got.shape == (512, 4)
    np.testing.assert_allclose(got, reference(model_dir / "tiny.onnx", x), rtol=1e-5, atol=1e-6)


def test_system_shared_memory(served: tuple[DaemonProcess, int], model_dir: Path) -> None:
    d, port = served
    # Over TCP a register is refused: the peer has no user id to check the object's owner against.
    tcp = tritonhttp.InferenceServerClient(url=f"127.0.0.1:{port}")
    with pytest.raises(InferenceServerException, match="only available to local clients"):
        tcp.register_system_shared_memory("in", "/edged_test_tc_in", 64)
    tcp.close()

    bridge = Bridge(d.socket)
    client = tritonhttp.InferenceServerClient(url=f"127.0.0.1:{bridge.port}")
    x = np.random.default_rng(6).standard_normal((1, 16)).astype(np.float32)
    in_handle = shm.create_shared_memory_region("in", "/edged_test_tc_in", x.nbytes)
    out_handle = shm.create_shared_memory_region("out", "/edged_test_tc_out", 16)
    try:
        shm.set_shared_memory_region(in_handle, [x])
        client.register_system_shared_memory("in", "/edged_test_tc_in", x.nbytes)
        client.register_system_shared_memory("out", "/edged_test_tc_out", 16)
        assert {r["name"] for r in client.get_system_shared_memory_status()} == {"in", "out"}
        inp = tritonhttp.InferInput("x", [1, 16], "FP32")
        inp.set_shared_memory("in", x.nbytes)
        out = tritonhttp.InferRequestedOutput("probs")
        out.set_shared_memory("out", 16)
        result = client.infer("tiny", [inp], outputs=[out])
        meta = result.get_output("probs")
        assert meta is not None and meta["parameters"]["shared_memory_region"] == "out"
        assert "data" not in meta
        got = shm.get_contents_as_numpy(out_handle, np.float32, [1, 4])
        np.testing.assert_allclose(got, reference(model_dir / "tiny.onnx", x), rtol=1e-5, atol=1e-6)
        for _ in range(2):  # unregistering twice (and all, twice) succeeds, as on Triton
            client.unregister_system_shared_memory("in")
        for _ in range(2):
            client.unregister_system_shared_memory()
        assert client.get_system_shared_memory_status() == []
    finally:
        client.close()
        shm.destroy_shared_memory_region(in_handle)
        shm.destroy_shared_memory_region(out_handle)
        bridge.close()


def test_an_unloaded_model_answers_503_until_loaded(client: tritonhttp.InferenceServerClient) -> None:
    x = np.ones((1, 16), np.float32)
    inp = tritonhttp.InferInput("x", [1, 16], "FP32")
    inp.set_data_from_numpy(x)
    client.unload_model("spare")
    assert not client.is_model_ready("spare")
    for _ in range(2):
        with pytest.raises(InferenceServerException) as e:
            client.infer("spare", [inp])
        assert e.value.status() == "503" and "unloaded" in str(e.value.message())
    client.load_model("spare")
    assert client.is_model_ready("spare")
    out = client.infer("spare", [inp]).as_numpy("probs")
    assert out is not None and out.shape == (1, 4)
