"""Triton's own Python clients against a real daemon over TCP, one module for both protocols:
tritonclient.http on the HTTP listener and tritonclient.grpc on the gRPC listener. Versions,
compressed requests and answers, system shared memory, and an unloaded model; where the protocols
differ (status codes, what a client's answer is made of), each is asserted exactly."""

from __future__ import annotations

import itertools
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as tritongrpc
import tritonclient.http as tritonhttp
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from tests.bridge import Bridge
from tests.helpers import DaemonProcess, write_config

pytestmark = pytest.mark.integration

PROTOCOLS = ["http", "grpc"]
# What each client reports as an error's status: HTTP's code, gRPC's status code by name.
STATUS = {
    "http": {"not_found": "404", "unavailable": "503"},
    "grpc": {"not_found": "StatusCode.NOT_FOUND", "unavailable": "StatusCode.UNAVAILABLE"},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def reference(model: Path, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    out: np.ndarray = sess.run(None, {"x": x})[0]
    return out


@dataclass
class Served:
    daemon: DaemonProcess
    ports: dict[str, int]  # protocol -> its TCP listener's port

    def url(self, protocol: str) -> str:
        return f"127.0.0.1:{self.ports[protocol]}"

    def client(self, protocol: str, url: str | None = None) -> Any:
        """tritonclient's client of ``protocol`` at ``url`` (default: the daemon's TCP listener)."""
        if protocol == "http":
            return tritonhttp.InferenceServerClient(url=url or self.url("http"), network_timeout=30)
        return tritongrpc.InferenceServerClient(url=url or self.url("grpc"))


def module(protocol: str) -> Any:
    return tritonhttp if protocol == "http" else tritongrpc


def as_dict(protocol: str, call: Any, *args: Any) -> Any:
    """An answer as JSON: tritonclient.http returns it so, tritonclient.grpc on request."""
    return call(*args) if protocol == "http" else call(*args, as_json=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("triton")
    ports = {"http": free_port(), "grpc": free_port()}
    cfg = write_config(
        tmp / "edged.toml",
        {
            "server": {
                "socket": str(tmp / "edged.sock"),
                "tcp": [f"127.0.0.1:{ports['http']}"],
                "grpc_tcp": [f"127.0.0.1:{ports['grpc']}"],
            },
            "cache": {"dir": str(tmp / "cache")},
            "build": {"block_ready": True},
            "models.tiny": {"path": str(model_dir / "tiny.onnx")},
            "models.spare": {"path": str(model_dir / "tiny_b.onnx")},
        },
    )
    d = DaemonProcess(cfg, tmp / "edged.sock", tmp / "edged.log").start()
    yield Served(d, ports)
    assert d.stop() == 0, d.log()


@pytest.fixture(params=PROTOCOLS)
def protocol(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def client(served: Served, protocol: str) -> Iterator[Any]:
    c = served.client(protocol)
    yield c
    c.close()


def test_versions(client: Any, protocol: str) -> None:
    assert client.is_server_ready()
    assert client.is_model_ready("tiny") and client.is_model_ready("tiny", "1")
    assert not client.is_model_ready("tiny", "2")
    assert as_dict(protocol, client.get_model_metadata, "tiny", "1")["versions"] == ["1"]
    with pytest.raises(InferenceServerException) as e:
        client.get_model_metadata("tiny", "2")
    assert e.value.status() == STATUS[protocol]["not_found"] and "no version '2'" in str(e.value.message())


# HTTP compresses each way on its own and sends tensors binary or as JSON; gRPC compresses the
# request as the client asks (the answer as the server's channel is set) and is always binary.
ALGORITHMS = [None, "gzip", "deflate"]
COMPRESSION = [
    pytest.param("http", req, resp, binary, id=f"http-{req}-{resp}-{'binary' if binary else 'json'}")
    for req, resp, binary in itertools.product(ALGORITHMS, ALGORITHMS, [True, False])
] + [pytest.param("grpc", req, None, True, id=f"grpc-{req}") for req in ALGORITHMS]


@pytest.mark.parametrize(("protocol", "request_alg", "response_alg", "binary"), COMPRESSION)
def test_compressed_infer(
    served: Served,
    model_dir: Path,
    protocol: str,
    request_alg: str | None,
    response_alg: str | None,
    binary: bool,
) -> None:
    # 512 rows: a 32 kB request and an 8 kB (binary) or 20 kB (JSON) answer, above compress_min_size.
    x = np.random.default_rng(5).standard_normal((512, 16)).astype(np.float32)
    client, tc = served.client(protocol), module(protocol)
    inp = tc.InferInput("x", list(x.shape), "FP32")
    try:
        if protocol == "http":
            inp.set_data_from_numpy(x, binary_data=binary)
            result = client.infer(
                "tiny",
                [inp],
                outputs=[tc.InferRequestedOutput("probs", binary_data=binary)],
                request_compression_algorithm=request_alg,
                response_compression_algorithm=response_alg,
            )
        else:
            inp.set_data_from_numpy(x)
            result = client.infer(
                "tiny", [inp], outputs=[tc.InferRequestedOutput("probs")], compression_algorithm=request_alg
            )
    finally:
        client.close()
    got = result.as_numpy("probs")
    assert got is not None and got.shape == (512, 4)
    np.testing.assert_allclose(got, reference(model_dir / "tiny.onnx", x), rtol=1e-5, atol=1e-6)


def local_url(served: Served, protocol: str) -> tuple[str, Bridge | None]:
    """A URL whose peer is local: HTTP through a bridge to the Unix socket (tritonclient.http
    speaks only host:port), gRPC on the gRPC socket itself (``[server] grpc_socket``'s default)."""
    if protocol == "http":
        bridge = Bridge(served.daemon.socket)
        return f"127.0.0.1:{bridge.port}", bridge
    return f"unix:{served.daemon.socket}.grpc", None


def test_system_shared_memory(served: Served, model_dir: Path, protocol: str) -> None:
    # Over TCP a register is refused: the peer has no user id to check the object's owner against.
    tcp = served.client(protocol)
    with pytest.raises(InferenceServerException, match="only available to local clients"):
        tcp.register_system_shared_memory("in", "/edged_test_tc_in", 64)
    tcp.close()

    url, bridge = local_url(served, protocol)
    client, tc = served.client(protocol, url), module(protocol)
    x = np.random.default_rng(6).standard_normal((1, 16)).astype(np.float32)
    in_handle = shm.create_shared_memory_region("in", "/edged_test_tc_in", x.nbytes)
    out_handle = shm.create_shared_memory_region("out", "/edged_test_tc_out", 16)
    try:
        shm.set_shared_memory_region(in_handle, [x])
        client.register_system_shared_memory("in", "/edged_test_tc_in", x.nbytes)
        client.register_system_shared_memory("out", "/edged_test_tc_out", 16)
        status = as_dict(protocol, client.get_system_shared_memory_status)
        names = {r["name"] for r in status} if protocol == "http" else set(status["regions"])
        assert names == {"in", "out"}
        inp = tc.InferInput("x", [1, 16], "FP32")
        inp.set_shared_memory("in", x.nbytes)
        out = tc.InferRequestedOutput("probs")
        out.set_shared_memory("out", 16)
        result = client.infer("tiny", [inp], outputs=[out])
        meta = result.get_output("probs")
        if protocol == "http":
            assert meta is not None and meta["parameters"]["shared_memory_region"] == "out"
            assert "data" not in meta
        else:  # the answer's tensor names its region; no raw contents travel
            assert meta is not None and meta.parameters["shared_memory_region"].string_param == "out"
            assert len(result.get_response().raw_output_contents) == 0
        got = shm.get_contents_as_numpy(out_handle, np.float32, [1, 4])
        np.testing.assert_allclose(got, reference(model_dir / "tiny.onnx", x), rtol=1e-5, atol=1e-6)
        for _ in range(2):  # unregistering twice (and all, twice) succeeds, as on Triton
            client.unregister_system_shared_memory("in")
        for _ in range(2):
            client.unregister_system_shared_memory()
        assert as_dict(protocol, client.get_system_shared_memory_status) == ([] if protocol == "http" else {})
    finally:
        client.close()
        shm.destroy_shared_memory_region(in_handle)
        shm.destroy_shared_memory_region(out_handle)
        if bridge is not None:
            bridge.close()


def test_an_unloaded_model_answers_unavailable_until_loaded(client: Any, protocol: str) -> None:
    tc = module(protocol)
    x = np.ones((1, 16), np.float32)
    inp = tc.InferInput("x", [1, 16], "FP32")
    inp.set_data_from_numpy(x)
    client.unload_model("spare")
    assert not client.is_model_ready("spare")
    for _ in range(2):
        with pytest.raises(InferenceServerException) as e:
            client.infer("spare", [inp])
        assert e.value.status() == STATUS[protocol]["unavailable"] and "unloaded" in str(e.value.message())
    client.load_model("spare")
    assert client.is_model_ready("spare")
    out = client.infer("spare", [inp]).as_numpy("probs")
    assert out is not None and out.shape == (1, 4)
