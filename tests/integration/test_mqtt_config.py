"""The [mqtt] table against a real broker: TLS with a client certificate, a password, a topic
prefix, the default device id, a broker that is down at boot, and keys that cannot work."""

from __future__ import annotations

import datetime
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edged.tools.demo import make_tiny_mlp
from edged.transports.mqtt.transport import FIRST_CONNECT_WAIT_S
from tests.integration.mosquitto import Broker, Peer, make_tls
from tests.integration.mqtt_daemon import Edged, code_of, json_request, probs

pytestmark = pytest.mark.integration

X = np.full((1, 16), 0.25, np.float32)


def _seconds_between(log: str, first: str, second: str) -> float:
    """Between the log lines holding ``first`` and ``second`` (their logging timestamps)."""

    def at(text: str) -> datetime.datetime:
        line = next(line for line in log.splitlines() if text in line)
        return datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")

    return (at(second) - at(first)).total_seconds()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return {"path": str(make_tiny_mlp(tmp_path_factory.mktemp("models") / "tiny.onnx"))}


def test_tls_client_certificate_password_prefix_and_default_device(tmp_path: Path, tiny: dict[str, Any]) -> None:
    tls = make_tls(tmp_path / "pki")
    broker = Broker(tmp_path / "broker", tls=tls, users={"edge": "s3cret", "app": "app-pw"})
    broker.start()
    models = {"tiny": tiny, "broken": {"path": str(tmp_path / "missing.onnx")}}
    d = Edged(
        tmp_path / "edge",
        broker.port,
        "",
        models,
        tmp_path / "cache",
        topic_prefix="plant/line1",
        username="edge",
        password="s3cret",
        tls={"ca": str(tls.ca), "cert": str(tls.client_cert), "key": str(tls.client_key)},
    )
    try:
        d.start()
        base = f"plant/line1/{socket.gethostname()}"  # device_id defaults to the host name
        with Peer(broker.port, tls=tls, auth=("app", "app-pw")) as p:
            p.subscribe(f"{base}/#")
            assert p.first(f"{base}/status", lambda r: r.retain).payload == b"online"
            broken = p.first(f"{base}/models/broken/state", lambda r: r.retain).json()
            assert broken["state"] == "failed" and "missing.onnx" in broken["reason"]
            p.subscribe("reply/tls")
            p.request(f"{base}/models/tiny/infer", json_request(X, "t-1"), "reply/tls", b"t-1")
            reply = p.first("reply/tls")
        assert code_of(reply) == "ok" and probs(reply).shape == (1, 4)
    finally:
        d.stop()
        d.kill()
        broker.stop()


def test_edged_starts_without_a_broker_and_connects_when_it_comes(tmp_path: Path, tiny: dict[str, Any]) -> None:
    broker = Broker(tmp_path / "broker")  # its port is chosen, nothing listens on it yet
    d = Edged(tmp_path / "edge", broker.port, "dev-late", {"tiny": tiny}, tmp_path / "cache")
    try:
        d.start()
        # A refused connection does not hold the boot up for the whole connect wait.
        waited = _seconds_between(d.log(), "serving on", "not reachable yet")
        assert waited < FIRST_CONNECT_WAIT_S / 2
        broker.start()
        with Peer(broker.port) as p:
            p.subscribe("edged/dev-late/status")
            p.first("edged/dev-late/status", lambda r: r.payload == b"online")
            p.subscribe("reply/late")
            p.request("edged/dev-late/models/tiny/infer", json_request(X), "reply/late", b"l-1")
            assert code_of(p.first("reply/late")) == "ok"
    finally:
        d.stop()
        d.kill()
        broker.stop()


@pytest.mark.parametrize(
    ("key", "value"), [("device_id", "a/b"), ("device_id", "fleet"), ("topic_prefix", "edged/#"), ("fleet_group", "g+")]
)
def test_topic_keys_that_cannot_work_stop_the_start(tmp_path: Path, tiny: dict[str, Any], key: str, value: str) -> None:
    keys: dict[str, Any] = {"device_id": "dev-x", key: value}
    device = keys.pop("device_id")
    d = Edged(tmp_path / "edge", 1, device, {"tiny": tiny}, tmp_path / "cache", **keys)
    d.start(wait_ready=False)
    assert d.proc is not None
    assert d.proc.wait(timeout=30) == 78  # EX_CONFIG: systemd does not restart it
    assert f"mqtt.{key}" in d.log()


@pytest.mark.parametrize(
    ("keys", "named"),
    [
        ({"homeassistant": {"enabled": True}, "telemetry_interval_s": 0}, "mqtt.homeassistant"),
        ({"homeassistant": {"enabled": True, "prefix": "ha/#"}}, "mqtt.homeassistant.prefix"),
    ],
)
def test_home_assistant_keys_that_cannot_work_stop_the_start(
    tmp_path: Path, tiny: dict[str, Any], keys: dict[str, Any], named: str
) -> None:
    d = Edged(tmp_path / "edge", 1, "dev-x", {"tiny": tiny}, tmp_path / "cache", **keys)
    d.start(wait_ready=False)
    assert d.proc is not None
    assert d.proc.wait(timeout=30) != 0
    assert named in d.log()
