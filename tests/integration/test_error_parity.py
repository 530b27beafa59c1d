"""The same fault gets the same error code on the socket, over MQTT and over gRPC.

One real daemon with a real mosquitto; every bad request of the table below is sent three ways:
the HTTP body, the same body as the MQTT payload (the binary tensor extension's header length
as the ``inference-header-content-length`` user property), and as a ModelInferRequest on the
gRPC socket. Every answer must carry the code the table expects: the code of edged/errors.py's
wire table, with the HTTP status and the gRPC status that table gives (the code in gRPC's
``edged-code`` trailing metadata), and gRPC's message must be HTTP's where the fault takes the
same form in both (GRPC_FORMS lists the others and gRPC's words for them).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import grpc
import pytest

from edged import errors
from edged.tools.demo import make_tiny_mlp
from edged.wire.proto import grpc_service_pb2 as pb
from tests.integration.mosquitto import Broker, Peer, module_broker
from tests.integration.mqtt_daemon import Edged
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
    grpc: bytes | None = None  # the ModelInferRequest's bytes, where the body does not convert
    grpc_error: str | None = None  # gRPC's words, where its form of the fault differs (GRPC_FORMS)


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


# Faults whose gRPC form is not the body's, and gRPC's words for them: a message that is not
# protobuf stands for one that is not JSON, typed contents have a field per datatype, raw
# contents carry their own length, and a message's size is its own.
GRPC_FORMS: dict[str, tuple[bytes | None, str]] = {
    "malformed JSON": (b"\x0a\x05ab", "the message is not a ModelInferRequest"),
    "body not an object": (b"\xff", "the message is not a ModelInferRequest"),
    "strings for a float": (None, "input 'x': FP32 values belong in 'fp32_contents', not 'bytes_contents'"),
    "numbers for BYTES": (None, "input 'text': BYTES values belong in 'bytes_contents', not 'int_contents'"),
    "binary data past the end": (None, "input 'x': shape [1, 16] of FP32 needs 64 bytes, got 10"),
    "binary data nobody owns": (None, "1 inputs need 1 raw input contents, the request has 2"),
    "JSON part over max_json": (None, "its raw contents are 16477 bytes, over the limit of 16384 (server.max_json)"),
    "body over max_body": (None, "bytes exceeds the limit of 65536 (server.max_body)"),
}
FAULTS.update({k: replace(FAULTS[k], grpc=raw, grpc_error=words) for k, (raw, words) in GRPC_FORMS.items()})


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


def _over_http(edge: Edged, fault: Fault) -> tuple[int, str, str]:
    headers = {"Content-Type": "application/json"}
    if fault.header_length is not None:
        headers = {
            "Content-Type": "application/octet-stream",
            "Inference-Header-Content-Length": str(fault.header_length),
        }
    with edge.client() as c:
        status, data, _ = c.request("POST", f"/v2/models/{fault.model}/infer", fault.body, headers)
    answer = json.loads(data)
    return status, str(answer["code"]), str(answer["error"])


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
def test_the_same_fault_gets_the_same_code_every_way(edge: Edged, peer: Peer, name: str) -> None:
    fault = FAULTS[name]
    table = errors.wire_codes()
    assert fault.code in table  # a code of the one shared table
    status, http_code, message = _over_http(edge, fault)
    body_code, property_code = _over_mqtt(peer, fault, name.encode())
    grpc_status, grpc_code, grpc_message = _over_grpc(edge, fault)
    assert (http_code, body_code, property_code, grpc_code) == (fault.code,) * 4, name
    assert status == table[fault.code].http_status
    assert grpc_status == table[fault.code].grpc_status
    assert grpc_message == message if fault.grpc_error is None else fault.grpc_error in grpc_message, grpc_message


def test_every_request_fault_code_is_covered() -> None:
    """The table exercises every client-fault code a tensor request can earn on both transports
    (shared memory codes are the socket's alone: MQTT carries no regions)."""
    client_codes = {"bad_request", "invalid_input", "payload_too_large", "model_not_found"}
    assert client_codes <= {f.code for f in FAULTS.values()}


# --- the same faults over gRPC -------------------------------------------------------------------
# Each fault's body as a ModelInferRequest, as tritonclient builds one: JSON data become typed
# contents, and where any input is binary every input travels as raw contents (one each).


def _typed_input(req: pb.ModelInferRequest, entry: dict[str, Any]) -> None:
    tensor = req.inputs.add(name=entry["name"], datatype=entry["datatype"], shape=entry["shape"])
    data = entry["data"]
    if any(isinstance(v, str) for v in data):
        tensor.contents.bytes_contents.extend(v.encode() for v in data)
    elif entry["datatype"] == "BYTES":
        tensor.contents.int_contents.extend(data)  # numbers for BYTES: the field numbers travel in
    elif entry["datatype"] == "INT32":
        tensor.contents.int_contents.extend(data)
    else:
        tensor.contents.fp32_contents.extend(data)


def _raw_input(req: pb.ModelInferRequest, entry: dict[str, Any], raw: bytes) -> bytes:
    """``entry``'s raw contents: its binary part (the rest returned), or its JSON data as bytes."""
    req.inputs.add(name=entry["name"], datatype=entry["datatype"], shape=entry["shape"])
    size = entry.get("parameters", {}).get("binary_data_size")
    if size is None:
        req.raw_input_contents.append(struct.pack(f"<{len(entry['data'])}f", *entry["data"]))
        return raw
    req.raw_input_contents.append(raw[:size])
    return raw[size:]


def as_grpc(fault: Fault) -> bytes:
    if fault.grpc is not None:
        return fault.grpc
    req = pb.ModelInferRequest(model_name=fault.model)
    hl = fault.header_length
    doc = json.loads(fault.body if hl is None else fault.body[:hl])
    raw = b"" if hl is None else fault.body[hl:]
    for entry in doc["inputs"]:
        if hl is None:
            _typed_input(req, entry)
        else:
            raw = _raw_input(req, entry, raw)
        if "pad" in entry:  # the JSON part's padding: a field other than the raw contents
            req.id = entry["pad"]
    if raw:  # bytes past every input's: raw contents no input owns
        req.raw_input_contents.append(raw)
    for o in doc.get("outputs", []):
        req.outputs.add(name=o["name"])
    return req.SerializeToString()


def _over_grpc(edge: Edged, fault: Fault) -> tuple[str, str, str]:
    with grpc.insecure_channel(f"unix:{edge.socket}.grpc") as ch:
        infer = ch.unary_unary("/inference.GRPCInferenceService/ModelInfer")  # bytes both ways
        with pytest.raises(grpc.RpcError) as e:
            infer(as_grpc(fault), timeout=30)
    trailing = dict(e.value.trailing_metadata() or ())  # type: ignore[attr-defined]
    return e.value.code().name, str(trailing.get("edged-code")), str(e.value.details())  # type: ignore[attr-defined]
