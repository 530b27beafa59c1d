"""MQTT against a real mosquitto and the daemon as a real subprocess (design sections 4 and 6)."""

from __future__ import annotations

import json
import math
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from edged import errors
from tests.helpers import wait_for
from tests.integration.mosquitto import Broker, Peer, module_broker, need
from tests.integration.mqtt_daemon import Edged, code_of, json_request, probs
from tests.integration.mqtt_edge import DEV, edge, mqtt_models, peer, socket_probs

pytestmark = pytest.mark.integration

__all__ = ["edge", "module_broker", "mqtt_models", "peer"]  # fixtures: imported so that pytest finds them

MODELS = f"edged/{DEV}/models"
OCTET = "application/octet-stream"


# --- availability and state --------------------------------------------------------------------


def test_status_online_and_model_states_are_retained(peer: Peer) -> None:
    peer.subscribe(f"edged/{DEV}/#")
    status = peer.first(f"edged/{DEV}/status", lambda r: r.retain)
    assert status.payload == b"online"
    for name in ("tiny", "slow", "slowq"):
        state = peer.first(f"{MODELS}/{name}/state", lambda r: r.retain).json()
        assert state["model"] == name and state["state"] == "ready" and state["reason"] == ""


def test_telemetry_reports_memory_counts_and_latency(peer: Peer, edge: Edged) -> None:
    socket_probs(edge, np.zeros((1, 16), np.float32))  # warm-up requests are not counted: make one
    topic = f"edged/{DEV}/telemetry"
    peer.subscribe(topic, qos=0)
    doc = peer.first(topic, lambda r: r.json()["models"]["tiny"]["requests"] > 0, timeout=10).json()
    assert doc["device"] == DEV and doc["ready"] is True
    mem = doc["memory"]
    assert mem["budget_bytes"] > 0 and mem["total_bytes"] >= mem["budget_bytes"]
    assert 0 < mem["used_bytes"] <= mem["budget_bytes"] and mem["available_bytes"] > 0
    tiny = doc["models"]["tiny"]
    assert tiny["state"] == "ready" and tiny["queue"] == 0 and tiny["p50_ms"] > 0
    assert tiny["p99_ms"] >= tiny["p50_ms"]


# --- request/response --------------------------------------------------------------------------


def test_json_round_trip_matches_the_socket(peer: Peer, edge: Edged) -> None:
    x = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
    peer.subscribe("reply/json")
    peer.request(f"{MODELS}/tiny/infer", json_request(x, "j-1"), "reply/json", b"corr-1", "application/json")
    r = peer.first("reply/json")
    assert r.correlation == b"corr-1"
    assert r.content_type == "application/json" and r.user["device"] == DEV
    body = r.json()
    assert body["id"] == "j-1" and body["model_name"] == "tiny"
    np.testing.assert_allclose(probs(r), socket_probs(edge, x), rtol=1e-6)


def test_raw_tensor_round_trip_replies_raw(peer: Peer, edge: Edged) -> None:
    x = np.random.default_rng(2).standard_normal((2, 16)).astype(np.float32)
    peer.subscribe("reply/raw")
    topic = f"{MODELS}/tiny/infer"
    # The input name is optional for a single-input model; dtype and shape take either spelling.
    peer.request(topic, x.tobytes(), "reply/raw", b"r-1", OCTET, [("dtype", "FP32"), ("shape", "2,16")])
    peer.request(
        topic, x.tobytes(), "reply/raw", b"r-2", OCTET, [("dtype", "float32"), ("shape", "[2, 16]"), ("input", "x")]
    )
    replies = peer.wait(
        lambda: len(peer.replies("reply/raw")) == 2 and peer.replies("reply/raw"), 10, "two raw replies"
    )
    want = socket_probs(edge, x)
    for corr in (b"r-1", b"r-2"):
        r = replies[corr]
        assert r.content_type == OCTET and r.user["device"] == DEV
        assert (r.user["name"], r.user["dtype"], r.user["shape"]) == ("probs", "FP32", "2,4")
        np.testing.assert_array_equal(np.frombuffer(r.payload, np.float32).reshape(2, 4), want)


def test_binary_tensor_extension_as_on_the_socket(peer: Peer, edge: Edged) -> None:
    x = np.random.default_rng(3).standard_normal((1, 16)).astype(np.float32)
    header = json.dumps(
        {
            "id": "b-1",
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 16], "parameters": {"binary_data_size": 64}}],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    peer.subscribe("reply/bin")
    peer.request(
        f"{MODELS}/tiny/infer",
        header + x.tobytes(),
        "reply/bin",
        b"b-1",
        OCTET,
        [("inference-header-content-length", str(len(header)))],
    )
    r = peer.first("reply/bin")
    n = int(r.user["inference-header-content-length"])
    doc = json.loads(r.payload[:n])
    assert doc["id"] == "b-1" and doc["outputs"][0]["parameters"]["binary_data_size"] == 16
    np.testing.assert_array_equal(np.frombuffer(r.payload[n:], np.float32).reshape(1, 4), socket_probs(edge, x))


def test_third_party_clients_mosquitto_rr_and_pub(
    module_broker: Broker, peer: Peer, edge: Edged, tmp_path: Path
) -> None:
    x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)
    topic = f"{MODELS}/tiny/infer"
    mosquitto_rr, mosquitto_pub = need("mosquitto_rr", "mosquitto-clients"), need("mosquitto_pub", "mosquitto-clients")
    rr = subprocess.run(
        [
            mosquitto_rr,
            "-p",
            str(module_broker.port),
            "-t",
            topic,
            "-e",
            "reply/rr",
            "-q",
            "1",
            "-m",
            json_request(x, "rr-1").decode(),
            "-W",
            "10",
            "-N",
            "-F",
            "%C|%P|%p",
        ],
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    assert rr.returncode == 0, rr.stderr
    ctype, props, payload = rr.stdout.split("|", 2)
    assert ctype == "application/json" and f"device:{DEV}" in props
    body = json.loads(payload)
    assert body["id"] == "rr-1"
    np.testing.assert_allclose(
        np.asarray(body["outputs"][0]["data"], np.float32).reshape(1, 4), socket_probs(edge, x), rtol=1e-6
    )
    # A raw tensor from a client that is not paho: properties as mosquitto encodes them.
    (tmp_path / "x.bin").write_bytes(x.tobytes())
    peer.subscribe("reply/pub")
    subprocess.run(
        [
            mosquitto_pub,
            "-p",
            str(module_broker.port),
            "-V",
            "mqttv5",
            "-q",
            "1",
            "-t",
            topic,
            "-f",
            str(tmp_path / "x.bin"),
            "-D",
            "publish",
            "content-type",
            OCTET,
            "-D",
            "publish",
            "user-property",
            "dtype",
            "FP32",
            "-D",
            "publish",
            "user-property",
            "shape",
            "1,16",
            "-D",
            "publish",
            "response-topic",
            "reply/pub",
            "-D",
            "publish",
            "correlation-data",
            "pub-1",
        ],
        check=True,
        timeout=20,
    )
    r = peer.first("reply/pub")
    assert r.correlation == b"pub-1" and r.user["shape"] == "1,4"
    np.testing.assert_array_equal(np.frombuffer(r.payload, np.float32).reshape(1, 4), socket_probs(edge, x))


def test_mqtt311_client_uses_reply_to_and_id(module_broker: Broker, edge: Edged) -> None:
    x = np.random.default_rng(4).standard_normal((1, 16)).astype(np.float32)
    with Peer(module_broker.port, v5=False) as v3:
        v3.subscribe("reply/v3")
        v3.request(f"{MODELS}/tiny/infer", json_request(x, "v3-ok", reply_to="reply/v3"))
        v3.request(f"{MODELS}/nope/infer", json_request(x, "v3-err", reply_to="reply/v3"))
        v3.wait(lambda: len(v3.on("reply/v3")) >= 2, 10, "two replies")
        by_id = {r.json()["id"]: r.json() for r in v3.on("reply/v3")}
    np.testing.assert_allclose(
        np.asarray(by_id["v3-ok"]["outputs"][0]["data"], np.float32).reshape(1, 4), socket_probs(edge, x), rtol=1e-6
    )
    assert by_id["v3-err"]["code"] == "model_not_found" and "nope" in by_id["v3-err"]["error"]


def test_raw_request_without_input_name_loads_a_lazy_model(peer: Peer, edge: Edged) -> None:
    topic = f"{MODELS}/lazy/state"
    peer.subscribe(topic)
    assert peer.first(topic, lambda r: r.retain).json()["state"] == "lazy"
    x = np.random.default_rng(5).standard_normal((1, 16)).astype(np.float32)
    peer.subscribe("reply/lazy")
    # The input's name is only known once the model is loaded: edged loads it to find out.
    peer.request(
        f"{MODELS}/lazy/infer", x.tobytes(), "reply/lazy", b"z-1", OCTET, [("dtype", "FP32"), ("shape", "1,16")]
    )
    r = peer.first("reply/lazy")
    assert r.content_type == OCTET, r.payload
    np.testing.assert_array_equal(np.frombuffer(r.payload, np.float32).reshape(1, 4), socket_probs(edge, x))
    peer.first(topic, lambda m: m.json()["state"] == "ready")
    assert [m.json()["state"] for m in peer.on(topic)] == ["lazy", "loading", "warming", "ready"]


# --- errors ------------------------------------------------------------------------------------

_X = np.zeros((1, 16), np.float32)
BAD: dict[str, tuple[str, bytes, str, list[tuple[str, str]], str]] = {
    # correlation: (model, payload, content type, user properties, expected code)
    "malformed-json": ("tiny", b"{not json", "application/json", [], "bad_request"),
    "no-inputs": ("tiny", b'{"id": "n"}', "", [], "bad_request"),
    "wrong-input-name": ("tiny", json_request(_X).replace(b'"x"', b'"y"'), "", [], "invalid_input"),
    "wrong-json-dtype": ("tiny", json_request(_X).replace(b"FP32", b"INT32"), "", [], "invalid_input"),
    "raw-fp64": (
        "tiny",
        _X.astype(np.float64).tobytes(),
        OCTET,
        [("dtype", "FP64"), ("shape", "1,16")],
        "invalid_input",
    ),
    "raw-unknown-dtype": ("tiny", _X.tobytes(), OCTET, [("dtype", "FP99"), ("shape", "1,16")], "bad_request"),
    "raw-wrong-shape": ("tiny", _X[:, :15].tobytes(), OCTET, [("dtype", "FP32"), ("shape", "1,15")], "invalid_input"),
    "raw-short-payload": ("tiny", _X.tobytes()[:10], OCTET, [("dtype", "FP32"), ("shape", "1,16")], "bad_request"),
    "raw-no-dtype": ("tiny", _X.tobytes(), OCTET, [("shape", "1,16")], "bad_request"),
    "raw-bad-shape": ("tiny", _X.tobytes(), OCTET, [("dtype", "FP32"), ("shape", "one")], "bad_request"),
    "raw-wrong-input": (
        "tiny",
        _X.tobytes(),
        OCTET,
        [("dtype", "FP32"), ("shape", "1,16"), ("input", "z")],
        "invalid_input",
    ),
    "unknown-model": ("nope", json_request(_X), "", [], "model_not_found"),
    # An unknown model is a 404 whatever the body holds, as on the socket.
    "unknown-model-no-inputs": ("nope", b'{"inputs": []}', "", [], "model_not_found"),
    "unknown-model-raw-garbage": ("nope", b"\x00\x01", OCTET, [("dtype", "FP99")], "model_not_found"),
    "header-length-negative": ("tiny", b"{}", OCTET, [("inference-header-content-length", "-1")], "bad_request"),
}


def test_bad_payloads_get_the_socket_error_codes(peer: Peer, edge: Edged) -> None:
    peer.subscribe("reply/bad")
    for corr, (model, payload, ctype, user, _) in BAD.items():
        peer.request(f"{MODELS}/{model}/infer", payload, "reply/bad", corr.encode(), ctype, user)
    replies = peer.wait(
        lambda: len(peer.replies("reply/bad")) == len(BAD) and peer.replies("reply/bad"),
        10,
        "an answer to every bad request",
    )
    for corr, (*_, code) in BAD.items():
        r = replies[corr.encode()]
        doc = r.json()
        assert (doc["code"], r.user["code"], r.content_type) == (code, code, "application/json"), corr
        assert doc["error"]
    with edge.client() as c, pytest.raises(errors.InvalidInputError) as socket_err:
        c.infer("tiny", {"x": np.zeros((1, 15), np.float32)})
    assert socket_err.value.code == BAD["raw-wrong-shape"][-1]  # the socket's code for the same input
    with edge.client() as c:
        status, body, _ = c.request("POST", "/v2/models/nope/infer", b'{"inputs": []}')
    assert (status, json.loads(body)["code"]) == (404, BAD["unknown-model-no-inputs"][-1])


def test_requests_without_a_reply_path_are_logged_and_harmless(module_broker: Broker, peer: Peer, edge: Edged) -> None:
    before = edge.metric("edged_dropped_total", model="tiny", reason="no_reply_to")
    peer.request(f"{MODELS}/tiny/infer", json_request(_X, "lost-1"))  # MQTT 5, no Response Topic
    with Peer(module_broker.port, v5=False) as v3:  # 3.1.1, unreadable, so no reply_to either
        v3.request(f"{MODELS}/tiny/infer", b"\xff\x00garbage")
        wait_for(
            lambda: edge.metric("edged_dropped_total", model="tiny", reason="no_reply_to") >= before + 2,
            10,
            what="two dropped requests",
        )
    log = edge.log()
    assert "request without a Response Topic or 'reply_to' dropped" in log
    assert "unreadable request without a reply topic dropped" in log
    peer.subscribe("reply/after")
    peer.request(f"{MODELS}/tiny/infer", json_request(_X), "reply/after", b"after")
    assert code_of(peer.first("reply/after")) == "ok"


# --- queueing and expiry -----------------------------------------------------------------------


def test_full_queue_answers_busy_at_once(peer: Peer, edge: Edged) -> None:
    before = edge.metric("edged_dropped_total", model="slow", reason="busy")
    peer.subscribe("reply/busy")
    n = 8
    for i in range(n):
        peer.request(f"{MODELS}/slow/infer", json_request(_X), "reply/busy", f"busy-{i}".encode())
    peer.wait(lambda: len(peer.replies("reply/busy")) == n, 30, "an answer to every request")
    codes = [code_of(r) for r in peer.on("reply/busy")]
    assert set(codes) <= {"ok", "busy"} and "ok" in codes and codes.count("busy") >= 1
    # 'At once': a busy answer does not wait for the request that holds the queue.
    assert codes.index("busy") < codes.index("ok")
    assert edge.metric("edged_dropped_total", model="slow", reason="busy") - before == codes.count("busy")


def test_expired_request_is_dropped_and_counted(peer: Peer, edge: Edged) -> None:
    topic = f"{MODELS}/slowq/infer"
    peer.subscribe("reply/exp")
    # How long one request takes now, on this machine, under this load...
    for i in range(4):
        peer.request(topic, json_request(_X), "reply/exp", f"probe-{i}".encode())
    peer.wait(lambda: len(peer.replies("reply/exp")) >= 1, 30, "the first probe")
    t1 = time.monotonic()
    peer.wait(lambda: len(peer.replies("reply/exp")) >= 4, 30, "the probes")
    per_request = (time.monotonic() - t1) / 3
    # ...so that a backlog of about 2 s sits ahead of a request that expires after 1 s.
    blockers = min(60, math.ceil(2.0 / per_request) + 1)
    for i in range(blockers):
        peer.request(topic, json_request(_X), "reply/exp", f"blk-{i}".encode())
    peer.request(topic, json_request(_X), "reply/exp", b"late", expiry=1)
    wait_for(
        lambda: edge.metric("edged_dropped_total", model="slowq", reason="expired") == 1,
        30,
        what="the expired request to be counted",
    )
    replies = peer.wait(
        lambda: len(peer.replies("reply/exp")) >= 4 + blockers and peer.replies("reply/exp"),
        30,
        "every blocker answered",
    )
    assert b"late" not in replies
    assert all(code_of(r) == "ok" for r in replies.values())
