"""MQTT when things go wrong: the broker restarts mid-stream, the daemon is killed or away, and
a fleet of two daemons shares one broker's requests."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edged.tools.demo import make_tiny_mlp
from tests.helpers import wait_for
from tests.integration.mosquitto import Broker, Peer, broker, module_broker
from tests.integration.mqtt_daemon import Edged, code_of, json_request, probs

pytestmark = pytest.mark.integration
__all__ = ["broker", "module_broker"]  # fixtures: imported so that pytest finds them

X = np.linspace(-2, 2, 16, dtype=np.float32).reshape(1, 16)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    path = make_tiny_mlp(tmp_path_factory.mktemp("models") / "tiny.onnx")
    return {"tiny": {"path": str(path)}}


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _reply_props(topic: str, correlation: bytes) -> Properties:
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    props.ResponseTopic = topic
    props.CorrelationData = correlation
    return props


def _send(peer: Peer, topic: str, reply: str, ids: range) -> None:
    for i in ids:
        peer.request(topic, json_request(X, f"s{i}"), reply, f"s{i}".encode())


def test_broker_restart_mid_stream_loses_no_qos1_request(
    broker: Broker, tiny: dict[str, Any], cache: Path, tmp_path: Path, daemons: list[Edged]
) -> None:
    topic, n = "edged/dev-r/models/tiny/infer", 400
    # After the outage the broker delivers the backlog at once: a queue that holds it answers
    # every request (a shorter one answers the overflow 'busy', which is an answer, not a loss).
    models = {"tiny": dict(tiny["tiny"], queue_depth=n)}
    d = Edged(tmp_path / "edge", broker.port, "dev-r", models, cache)
    d.start()
    daemons.append(d)
    # A persistent session of its own, as a sensor that must not lose answers would have.
    with Peer(broker.port, client_id="req-restart", session_expiry=300) as p:
        p.subscribe("reply/stream")
        _send(p, topic, "reply/stream", range(n // 2))
        p.wait(lambda: len(p.replies("reply/stream")) >= 20, 10, "the stream to be under way")
        broker.restart()
        _send(p, topic, "reply/stream", range(n // 2, n))  # queued by paho until it reconnects
        replies = p.wait(
            lambda: len(p.replies("reply/stream")) == n and p.replies("reply/stream"), 60, f"all {n} answers"
        )
        assert p.connects >= 2
    bad = {c: r.payload[:200] for c, r in replies.items() if code_of(r) != "ok" or r.json()["id"] != c.decode()}
    assert not bad
    assert "session resumed" in d.log()


def test_requests_sent_while_edged_is_away_are_answered(
    module_broker: Broker, tiny: dict[str, Any], cache: Path, tmp_path: Path, daemons: list[Edged]
) -> None:
    d = Edged(tmp_path / "edge", module_broker.port, "dev-p", tiny, cache)
    d.start()
    daemons.append(d)
    status, topic = "edged/dev-p/status", "edged/dev-p/models/tiny/infer"
    with Peer(module_broker.port) as p:
        p.subscribe(status)
        p.subscribe("reply/away")
        p.first(status, lambda r: r.payload == b"online")
        # Retained by mistake: ignored when it is sent (the broker forwards it live with its
        # flag, as published) and never replayed at a reconnect.
        p.client.publish(
            topic, json_request(X, "kept"), qos=1, retain=True, properties=_reply_props("reply/away", b"kept")
        )
        wait_for(
            lambda: d.metric("edged_dropped_total", model="tiny", reason="retained") == 1,
            10,
            what="the retained request to be ignored",
        )
        assert "retained request on edged/dev-p/models/tiny/infer ignored" in d.log()
        assert d.stop() == 0
        p.first(status, lambda r: r.payload == b"offline")  # published on a clean stop
        _send(p, topic, "reply/away", range(5))
        d.start()  # the persistent session delivers what arrived meanwhile
        replies = p.wait(
            lambda: len(p.replies("reply/away")) == 5 and p.replies("reply/away"),
            30,
            "the five requests sent while edged was away",
        )
        p.client.publish(topic, b"", qos=1, retain=True)  # clear it for the other tests
        p.request(topic, json_request(X, "last"), "reply/away", b"last")
        p.wait(lambda: b"last" in p.replies("reply/away"), 10, "a request after the retained one")
        assert b"kept" not in p.replies("reply/away")
    assert all(code_of(r) == "ok" for r in replies.values())
    with Peer(module_broker.port) as late:
        late.subscribe(status)
        assert late.first(status, lambda r: r.retain).payload == b"online"


def test_last_will_marks_a_killed_daemon_offline(
    module_broker: Broker, tiny: dict[str, Any], cache: Path, tmp_path: Path, daemons: list[Edged]
) -> None:
    # This daemon speaks MQTT 3.1.1 itself: replies go to the 'reply_to' of the JSON body.
    d = Edged(tmp_path / "edge", module_broker.port, "dev-k", tiny, cache, protocol="3.1.1")
    d.start()
    daemons.append(d)
    status = "edged/dev-k/status"
    with Peer(module_broker.port) as p, Peer(module_broker.port, v5=False) as v3:
        p.subscribe(status)
        p.first(status, lambda r: r.payload == b"online")
        v3.subscribe("reply/k")
        v3.request("edged/dev-k/models/tiny/infer", json_request(X, "k-1", reply_to="reply/k"))
        reply = v3.first("reply/k")
        assert reply.json()["id"] == "k-1" and probs(reply).shape == (1, 4)
        d.kill()  # SIGKILL: no goodbye, the broker sends the will
        p.first(status, lambda r: r.payload == b"offline")
    with Peer(module_broker.port) as late:
        late.subscribe(status)
        assert late.first(status, lambda r: r.retain).payload == b"offline"


def test_fleet_shared_subscription_spreads_a_burst_over_two_daemons(
    module_broker: Broker, tiny: dict[str, Any], cache: Path, tmp_path: Path, daemons: list[Edged]
) -> None:
    f1, f2 = (
        Edged(tmp_path / name, module_broker.port, name, tiny, cache, fleet_group="line1")
        for name in ("dev-f1", "dev-f2")
    )
    daemons += [f1, f2]
    for d in (f1, f2):
        d.start(wait_ready=False)
    for d in (f1, f2):
        d.wait_ready()
    topic = "edged/fleet/models/tiny/infer"
    with Peer(module_broker.port) as p:
        p.subscribe("reply/fleet")
        _send(p, topic, "reply/fleet", range(60))
        first = p.wait(lambda: len(p.replies("reply/fleet")) == 60 and p.replies("reply/fleet"), 20, "60 fleet answers")
        by_device = collections.Counter(r.user["device"] for r in first.values())
        assert set(by_device) == {"dev-f1", "dev-f2"}, by_device
        assert all(code_of(r) == "ok" for r in first.values())
        # A device that dies stops taking a share at once: its fleet session ends with it.
        f2.kill()
        p.subscribe("edged/dev-f2/status")
        p.first("edged/dev-f2/status", lambda r: r.payload == b"offline")
        _send(p, topic, "reply/fleet", range(100, 120))
        replies = p.wait(
            lambda: len(p.replies("reply/fleet")) == 80 and p.replies("reply/fleet"),
            20,
            "the 20 requests sent after dev-f2 died",
        )
    after = [replies[f"s{i}".encode()] for i in range(100, 120)]
    assert {r.user["device"] for r in after} == {"dev-f1"}
