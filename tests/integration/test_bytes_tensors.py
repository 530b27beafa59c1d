"""BYTES tensors: a real daemon serving an ONNX model with string inputs and outputs
through ONNX Runtime, over the socket (JSON, the binary extension, shared memory, batching) and
MQTT; the framing checked against Triton's own client library (tritonclient.utils)."""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from edged import errors
from edged.client import AsyncClient
from tests.helpers import DaemonProcess, while_held
from tests.integration.mosquitto import Peer, module_broker
from tests.integration.mqtt_daemon import Edged

pytestmark = pytest.mark.integration

__all__ = ["module_broker"]  # a fixture: imported so that pytest finds it

TEXT = np.array([b"hello", b"", "h\u00e9".encode(), b"a\x00b"], dtype=object)
X = np.arange(8, dtype=np.float32).reshape(4, 2)
INFER = "/v2/models/strings/infer"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    from tests.helpers import write_config
    from tests.string_model import make_string_model

    d = tmp_path_factory.mktemp("bytes")
    model = make_string_model(d / "strings.onnx")
    tables: dict[str, dict[str, Any]] = {
        "server": {"socket": str(d / "edged.sock")},
        "cache": {"dir": str(d / "cache")},
        "build": {"block_ready": True},
        # Batched, and the model reports its batch; a batch forms behind a worker held by the
        # test-only wedge (edged/lifecycle/faults.py), which hangs nothing while its file is absent.
        "models.strings": {"path": str(model), "max_batch": 8, "max_queue_delay_us": 50_000, "queue_depth": 64},
    }
    env = {"EDGED_TEST_WEDGE": str(d / "wedge")}
    proc = DaemonProcess(write_config(d / "edged.toml", tables), d / "edged.sock", d / "edged.log", env=env)
    proc.start()
    yield proc
    assert proc.stop() == 0


def _post(d: DaemonProcess, body: bytes, header_length: int | None = None) -> tuple[int, Any, bytes]:
    headers = {"Content-Type": "application/json"}
    if header_length is not None:
        headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(header_length)}
    with d.client() as c:
        status, data, resp = c.request("POST", INFER, body, headers)
    hl = resp.getheader("Inference-Header-Content-Length")
    return status, json.loads(data[: int(hl)] if hl else data), data[int(hl) :] if hl else b""


def _binary_body(text: bytes, x: np.ndarray = X[:1], shape: list[int] | None = None) -> tuple[bytes, int]:
    doc = {
        "inputs": [
            {"name": "text", "datatype": "BYTES", "shape": shape or [1], "parameters": {"binary_data_size": len(text)}},
            {"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.reshape(-1).tolist()},
        ],
        "outputs": [{"name": "shout", "parameters": {"binary_data": True}}],
    }
    header = json.dumps(doc).encode()
    return header + text, len(header)


def test_metadata_says_bytes(daemon: DaemonProcess) -> None:
    with daemon.client() as c:
        meta = c.model_metadata("strings")
    assert {t["name"]: t["datatype"] for t in meta["inputs"]} == {"text": "BYTES", "x": "FP32"}
    assert {t["name"]: t["datatype"] for t in meta["outputs"]} == {"shout": "BYTES", "y": "FP32", "rows": "INT64"}


def test_the_client_sends_and_receives_bytes(daemon: DaemonProcess) -> None:
    with daemon.client() as c:
        out = c.infer("strings", {"text": TEXT, "x": X})
        # numpy str_ arrays are BYTES too (their UTF-8 bytes); answers are object arrays of bytes
        words = c.infer("strings", {"text": np.array(["ab", "\u00e9"]), "x": X[:2]})
    assert out["shout"].dtype == object and out["shout"].tolist() == [t + b"!" for t in TEXT]
    np.testing.assert_array_equal(out["y"], 2 * X)
    assert words["shout"].tolist() == [b"ab!", "\u00e9!".encode()]

    async def run() -> dict[str, np.ndarray]:
        client = AsyncClient(str(daemon.socket))
        try:
            return await client.infer("strings", {"text": TEXT[:1], "x": X[:1]})
        finally:
            await client.close()

    assert asyncio.run(run())["shout"].tolist() == [b"hello!"]


def test_binary_framing_is_tritons(daemon: DaemonProcess) -> None:
    """Input framed by tritonclient.utils, output read back by it: the same wire format."""
    text = np.array([b"one", b"tw\xc3\xb6"], dtype=object)
    body, hl = _binary_body(serialize_byte_tensor(text).item(), X[:2], [2])
    status, doc, binary = _post(daemon, body, hl)
    assert status == 200, doc
    (out,) = doc["outputs"]
    assert out["datatype"] == "BYTES" and out["shape"] == [2]
    assert out["parameters"]["binary_data_size"] == len(binary)
    assert deserialize_bytes_tensor(binary).tolist() == [b"one!", b"tw\xc3\xb6!"]


def test_json_strings_in_and_out(daemon: DaemonProcess) -> None:
    doc = {
        "inputs": [
            {"name": "text", "datatype": "BYTES", "shape": [2], "data": ["caf\u00e9", ""]},
            {"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [[1, 2], [3, 4]]},
        ]
    }
    status, out, _ = _post(daemon, json.dumps(doc).encode())
    assert status == 200, out
    by_name = {o["name"]: o for o in out["outputs"]}
    assert by_name["shout"] == {"name": "shout", "datatype": "BYTES", "shape": [2], "data": ["caf\u00e9!", "!"]}
    assert by_name["y"]["data"] == [2, 4, 6, 8]


@pytest.mark.parametrize(
    ("raw", "shape", "message"),
    [
        (struct.pack("<I", 100) + b"short", [1], "element 0's length prefix (100 bytes, at byte 0) runs past the end"),
        (struct.pack("<I", 2) + b"ab" + b"\x01\x00", [2], "element 1 has no room for its 4-byte length"),
        (struct.pack("<I", 1) + b"a" + b"extra", [1], "5 bytes follow the last of its 1 BYTES elements"),
        # two million elements cannot fit in 9 bytes: refused before anything is allocated
        (struct.pack("<I", 1) + b"a" + b"rest", [2_000_000], "needs at least 8000000 bytes"),
    ],
)
def test_bad_framing_is_a_precise_400(daemon: DaemonProcess, raw: bytes, shape: list[int], message: str) -> None:
    body, hl = _binary_body(raw, X[: shape[0]] if shape[0] <= 4 else X[:1], shape)
    status, doc, _ = _post(daemon, body, hl)
    assert status == 400 and doc["code"] == "bad_request", doc
    assert doc["error"].startswith("input 'text': ") and message in doc["error"], doc["error"]


def test_text_onnx_runtime_cannot_read_is_invalid_input(daemon: DaemonProcess) -> None:
    with daemon.client() as c, pytest.raises(errors.InvalidInputError, match="element 1 is not UTF-8"):
        c.infer("strings", {"text": np.array([b"ok", b"\xff"], dtype=object), "x": X[:2]})
    with daemon.client() as c:  # and the model still serves
        assert c.infer("strings", {"text": TEXT[:1], "x": X[:1]})["shout"].tolist() == [b"hello!"]


def test_bytes_through_shared_memory(daemon: DaemonProcess) -> None:
    """Inputs in a registered region in their serialised form (as Triton's shm clients write them)."""
    with daemon.client() as c:
        for text in (TEXT, TEXT[:2]):  # the region is reused for a shorter one
            out = c.infer_shm("strings", {"text": text, "x": X[: len(text)]})
            assert out["shout"].tolist() == [t + b"!" for t in text]


def test_a_bytes_output_into_shared_memory(daemon: DaemonProcess) -> None:
    """Written in its serialised form; the answer gives the size written."""
    with daemon.client() as c:
        region = c.shm_region("bytes-out", 256)
        doc = {
            "inputs": [
                {"name": "text", "datatype": "BYTES", "shape": [2], "data": ["to", "shm"]},
                {"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [0, 0, 0, 0]},
            ],
            "outputs": [
                {"name": "shout", "parameters": {"shared_memory_region": "bytes-out", "shared_memory_byte_size": 256}}
            ],
        }
        status, data, _ = c.request("POST", INFER, json.dumps(doc).encode(), {"Content-Type": "application/json"})
        assert status == 200, data
        (out,) = json.loads(data)["outputs"]
        size = out["parameters"]["shared_memory_byte_size"]
        assert out["datatype"] == "BYTES" and size == 2 * 4 + len(b"to!shm!")
        assert deserialize_bytes_tensor(region.array_view[:size].tobytes()).tolist() == [b"to!", b"shm!"]


def test_concurrent_bytes_requests_are_batched_each_with_its_own_answer(daemon: DaemonProcess) -> None:
    texts = [np.array([f"r{i}-{j}".encode() for j in range(1 + i % 3)], dtype=object) for i in range(24)]

    async def fire() -> list[dict[str, np.ndarray] | BaseException]:
        clients = [AsyncClient(str(daemon.socket)) for _ in texts]
        try:
            return await asyncio.gather(
                *(
                    c.infer("strings", {"text": t, "x": np.zeros((len(t), 2), np.float32)})
                    for c, t in zip(clients, texts)
                ),
                return_exceptions=True,
            )
        finally:
            for c in clients:
                await c.close()

    biggest = 0
    wedge = daemon.socket.parent / "wedge"
    for text, out in zip(texts, while_held(daemon, wedge, "strings", len(texts), lambda: asyncio.run(fire()))):
        assert not isinstance(out, BaseException), out
        assert out["shout"].tolist() == [t + b"!" for t in text]  # its own rows, in order
        biggest = max(biggest, int(out["rows"][0]))
    assert biggest > 3, "no batch ever held more than one request"


def test_bytes_over_mqtt(module_broker: Any, tmp_path: Path) -> None:
    """JSON strings and the binary extension over MQTT, as on the socket."""
    from tests.string_model import make_string_model

    model = make_string_model(tmp_path / "strings.onnx")
    edge = Edged(tmp_path / "edge", module_broker.port, "dev-b", {"strings": {"path": str(model)}}, tmp_path / "c")
    edge.start()
    try:
        with Peer(module_broker.port) as peer:
            peer.subscribe("reply/bytes")
            topic = "edged/dev-b/models/strings/infer"
            doc = {
                "inputs": [
                    {"name": "text", "datatype": "BYTES", "shape": [1], "data": ["mqtt"]},
                    {"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]},
                ],
                "outputs": [{"name": "shout"}],
            }
            peer.request(topic, json.dumps(doc).encode(), "reply/bytes", b"json", "application/json")
            body, hl = _binary_body(serialize_byte_tensor(np.array([b"bin"], dtype=object)).item())
            user = [("inference-header-content-length", str(hl))]
            peer.request(topic, body, "reply/bytes", b"binary", "application/octet-stream", user)
            replies = peer.wait(lambda: len(peer.replies("reply/bytes")) == 2 and peer.replies("reply/bytes"), 10, "2")
        assert replies[b"json"].json()["outputs"][0]["data"] == ["mqtt!"]
        binary = replies[b"binary"]
        hl_out = int(binary.user["inference-header-content-length"])
        assert deserialize_bytes_tensor(binary.payload[hl_out:]).tolist() == [b"bin!"]
    finally:
        assert edge.stop() == 0
