"""The same fault gets the same error code on the socket and over MQTT.

One real daemon with a real mosquitto; every bad request of the table below is sent both ways,
the HTTP body as the MQTT payload (the binary tensor extension's header length as the
``inference-header-content-length`` user property), and both answers must carry the code the
table expects: the code of edged/errors.py's wire table, with the HTTP status that table gives.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from edged import errors
from edged.tools.demo import make_tiny_mlp
from tests.integration.mosquitto import Broker, Peer, module_broker
from tests.integration.test_mqtt import Edged
from tests.string_model import make_string_model

pytestmark = pytest.mark.integration

__all__ = ["module_broker"]  # a fixture: imported so that pytest finds it

DEV = "parity"
MAX_BODY, MAX_JSON = 64 * 1024, 16 * 1024


@dataclass(frozen=True)
class Fault:
    model: str
    body: bytes
    code: str
    header_length: int | None = None


def _doc(*inputs: dict[str, Any], **extra: Any) -> bytes:
    return json.dumps({"inputs": list(inputs), **extra}).encode()


def _x(name: str = "x", datatype: str = "FP32", shape: list[int] | None = None, n: int = 16) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": shape or [1, 16], "data": [0] * n}


def _text(data: list[str]) -> dict[str, Any]:
    return {"name": "text", "datatype": "BYTES", "shape": [len(data)], "data": data}


def _binary(model_inputs: list[dict[str, Any]], raw: bytes) -> tuple[bytes, int]:
    header = json.dumps({"inputs": model_inputs}).encode()
    return header + raw, len(header)


def _bin_x(size: int, sent: int) -> Fault:
    meta = {"name": "x", "datatype": "FP32", "shape": [1, 16], "parameters": {"binary_data_size": size}}
    body, hl = _binary([meta], b"\0" * sent)
    return Fault("tiny", body, "bad_request", hl)


def _bin_text(raw: bytes, code: str = "bad_request") -> Fault:
    meta = {"name": "text", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": len(raw)}}
    body, hl = _binary([meta, _x(shape=[1, 2], n=2)], raw)
    return Fault("strings", body, code, hl)


STRING_X = _x(shape=[1, 2], n=2)
FAULTS: dict[str, Fault] = {
    "unknown model": Fault("nope", _doc(_x()), "model_not_found"),
    "unknown model, empty inputs": Fault("nope", _doc(), "model_not_found"),
    "malformed JSON": Fault("tiny", b'{"inputs": [', "bad_request"),
    "body not an object": Fault("tiny", b"[1, 2]", "bad_request"),
    "no inputs": Fault("tiny", _doc(), "bad_request"),
    "missing input": Fault("strings", _doc(STRING_X), "invalid_input"),
    "unknown input": Fault("tiny", _doc(_x("z")), "invalid_input"),
    "too many inputs": Fault("tiny", _doc(_x(), _x("y")), "invalid_input"),
    "input given twice": Fault("strings", _doc(STRING_X, STRING_X), "bad_request"),
    "wrong datatype": Fault("tiny", _doc(_x(datatype="INT32")), "invalid_input"),
    "unsupported datatype": Fault("tiny", _doc(_x(datatype="FP8")), "bad_request"),
    "wrong shape": Fault("tiny", _doc(_x(shape=[1, 15], n=15)), "invalid_input"),
    "data count not the shape's": Fault("tiny", _doc(_x(n=15)), "bad_request"),
    "strings for a float": Fault("tiny", _doc(dict(_x(), data=["a"] * 16)), "bad_request"),
    "numbers for BYTES": Fault("strings", _doc(dict(_text(["a"]), data=[1]), STRING_X), "bad_request"),
    "wrong byte size": _bin_x(60, 60),
    "binary data past the end": _bin_x(64, 10),
    "binary data nobody owns": _bin_x(64, 70),
    "BYTES length prefix past the end": _bin_text(struct.pack("<I", 9) + b"abc"),
    "BYTES without a length prefix": _bin_text(b"ab"),
    "text ONNX Runtime cannot read": _bin_text(struct.pack("<I", 1) + b"\xff", "invalid_input"),
    "unknown output": Fault("tiny", _doc(_x(), outputs=[{"name": "nope"}]), "bad_request"),
    "JSON part over max_json": Fault("tiny", _doc(dict(_x(), pad="." * MAX_JSON)), "payload_too_large"),
    "body over max_body": Fault("tiny", _doc(dict(_x(), pad="." * MAX_BODY)), "payload_too_large"),
}


@pytest.fixture(scope="module")
def edge(module_broker: Broker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edged]:
    d = tmp_path_factory.mktemp("parity")
    models = {
        "tiny": {"path": str(make_tiny_mlp(d / "tiny.onnx"))},
        "strings": {"path": str(make_string_model(d / "strings.onnx"))},
    }
    extra = {"server": {"max_body": f"{MAX_BODY // 1024}KiB", "max_json": f"{MAX_JSON // 1024}KiB"}}
    daemon = Edged(d, module_broker.port, DEV, models, d / "cache", extra=extra)
    daemon.start()
    yield daemon
    assert daemon.stop() == 0


@pytest.fixture(scope="module")
def peer(module_broker: Broker, edge: Edged) -> Iterator[Peer]:
    with Peer(module_broker.port) as p:
        p.subscribe("parity/reply")
        yield p


def _over_http(edge: Edged, fault: Fault) -> tuple[int, str]:
    headers = {"Content-Type": "application/json"}
    if fault.header_length is not None:
        headers = {
            "Content-Type": "application/octet-stream",
            "Inference-Header-Content-Length": str(fault.header_length),
        }
    with edge.client() as c:
        status, data, _ = c.request("POST", f"/v2/models/{fault.model}/infer", fault.body, headers)
    return status, str(json.loads(data)["code"])


def _over_mqtt(peer: Peer, fault: Fault, correlation: bytes) -> tuple[str, str]:
    user: list[tuple[str, str]] = []
    content_type = "application/json"
    if fault.header_length is not None:
        user = [("inference-header-content-length", str(fault.header_length))]
        content_type = "application/octet-stream"
    topic = f"edged/{DEV}/models/{fault.model}/infer"
    peer.request(topic, fault.body, "parity/reply", correlation, content_type, user)
    reply = peer.wait(lambda: peer.replies("parity/reply").get(correlation), 15, f"the reply to {correlation!r}")
    return str(reply.json()["code"]), reply.user["code"]


@pytest.mark.parametrize("name", list(FAULTS))
def test_the_same_fault_gets_the_same_code_both_ways(edge: Edged, peer: Peer, name: str) -> None:
    fault = FAULTS[name]
    table = errors.wire_codes()
    assert fault.code in table  # a code of the one shared table
    status, http_code = _over_http(edge, fault)
    body_code, property_code = _over_mqtt(peer, fault, name.encode())
    assert (http_code, body_code, property_code) == (fault.code, fault.code, fault.code), name
    assert status == table[fault.code].http_status


def test_every_request_fault_code_is_covered() -> None:
    """The table exercises every client-fault code a tensor request can earn on both transports
    (shared memory codes are the socket's alone: MQTT carries no regions)."""
    client_codes = {"bad_request", "invalid_input", "payload_too_large", "model_not_found"}
    assert client_codes <= {f.code for f in FAULTS.values()}
