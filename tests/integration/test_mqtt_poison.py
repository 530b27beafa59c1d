"""MQTT cannot poison the session: against a real mosquitto that redelivers.

A request that stalls edged's event loop past the broker keep-alive has its acknowledgement held
up: the broker drops edged and redelivers the request at every reconnect, so edged would freeze
again, at every restart too, until its session was cleared by hand. So a request must not stall
the loop (however many properties it carries), and one that edged died on must be dropped when it
comes back.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edged.tools.demo import make_tiny_mlp
from tests.helpers import FREEZE_S, HealthProber, wait_for
from tests.integration.mosquitto import Broker, Peer, broker
from tests.integration.mqtt_daemon import Edged, code_of, json_request

pytestmark = pytest.mark.integration
__all__ = ["broker"]  # a fixture: imported so that pytest finds it

X = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)
TOPIC = "edged/dev-p/models/tiny/infer"
# 50,000 user properties (350 KB): read by paho's own reader on the event loop, they would hold
# it for seconds (8.2 s where it was measured).
BOMB_PROPERTIES = 50_000


@pytest.fixture
def tiny(tmp_path: Path) -> dict[str, dict[str, Any]]:
    return {"tiny": {"path": str(make_tiny_mlp(tmp_path / "tiny.onnx"))}}


def test_a_property_bomb_neither_freezes_edged_nor_comes_back(
    broker: Broker, tiny: dict[str, Any], tmp_path: Path, daemons: list[Edged]
) -> None:
    # A 2 s keep-alive: a loop stalled for 3 s loses the connection (the broker allows 1.5x).
    d = Edged(tmp_path / "edge", broker.port, "dev-p", tiny, tmp_path / "cache", keepalive_s=2)
    d.start()
    daemons.append(d)
    with Peer(broker.port) as p, HealthProber(d.socket).running() as prober:
        p.subscribe("reply/bomb")
        p.request(TOPIC, json_request(X, "bomb"), "reply/bomb", b"bomb", user=[("k", "v")] * BOMB_PROPERTIES)
        reply = p.first("reply/bomb", timeout=60)
        assert code_of(reply) == "ok" and reply.json()["id"] == "bomb"
        # Later traffic is answered after it; nothing is redelivered or answered twice.
        p.request(TOPIC, json_request(X, "after"), "reply/bomb", b"after")
        p.wait(lambda: b"after" in p.replies("reply/bomb"), 30, "the next request's answer")
    assert sum(r.correlation == b"bomb" for r in p.on("reply/bomb")) == 1
    assert "connection to" not in d.log(), d.log()[-3000:]  # never dropped by the broker
    assert d.metric("edged_dropped_total", model="tiny", reason="duplicate") == 0
    assert prober.worst < FREEZE_S, f"a health check waited {prober.worst:.3f} s"


def test_a_message_edged_dies_on_is_dropped_when_redelivered(
    broker: Broker, tiny: dict[str, Any], tmp_path: Path, daemons: list[Edged]
) -> None:
    wedge = tmp_path / "wedge"
    d = Edged(
        tmp_path / "edge",
        broker.port,
        "dev-p",
        tiny,
        tmp_path / "cache",
        extra={"server": {"inline_threshold_us": 0}, "lifecycle": {"drain_timeout_s": 1.0}},
        # The test-only fault switch (edged/lifecycle/faults.py): once edged is ready, while the
        # file exists, each request a worker thread takes hangs on it.
        env={"EDGED_TEST_WEDGE": str(wedge), "WATCHDOG_USEC": "200000"},
    )
    d.start()
    daemons.append(d)
    journal = tmp_path / "cache" / "mqtt" / "edged-dev-p.running"
    with Peer(broker.port) as p:
        p.subscribe("reply/poison")
        p.subscribe("edged/dev-p/status")
        p.first("edged/dev-p/status", lambda r: r.payload == b"online")  # subscribed to its requests
        wedge.touch()
        p.request(TOPIC, json_request(X, "poison"), "reply/poison", b"poison")
        # Its worker hangs on it: started, never finished, it stays in the journal of running ones.
        wait_for(lambda: journal.read_bytes().strip(b"\0"), 20, what="the hanging request in the journal")
        answered_before = len(p.on("reply/poison"))
        t0 = time.monotonic()
        assert d.stop(timeout=30) == 0
        stop_s = time.monotonic() - t0
        wedge.unlink()
        d.start()
        wait_for(
            lambda: d.metric("edged_dropped_total", model="tiny", reason="redelivered") == 1,
            20,
            what="the redelivered poison to be dropped",
        )
        p.request(TOPIC, json_request(X, "next"), "reply/poison", b"next")
        reply = p.first("reply/poison", lambda r: r.correlation == b"next", timeout=20)
        assert code_of(reply) == "ok"
        assert len([r for r in p.on("reply/poison") if r.correlation == b"poison"]) == answered_before
    assert stop_s < 10, f"SIGTERM took {stop_s:.1f} s"
    assert "left unacknowledged" in d.log()
    assert "request dropped (redelivered)" in d.log()


def test_reading_a_message_is_bounded_by_the_request_timeout(
    broker: Broker, tiny: dict[str, Any], tmp_path: Path, daemons: list[Edged]
) -> None:
    # A 1 ms request timeout: reading 4 MB of JSON (in a worker thread) takes longer than that.
    d = Edged(
        tmp_path / "edge",
        broker.port,
        "dev-p",
        tiny,
        tmp_path / "cache",
        extra={"server": {"request_timeout_ms": 1}},
    )
    d.start()
    daemons.append(d)
    big = np.zeros((1, 16), np.float32)
    payload = json_request(big, "big", parameters={"pad": "x" * (4 << 20)})
    with Peer(broker.port) as p:
        p.subscribe("reply/big")
        p.request(TOPIC, payload, "reply/big", b"big")
        reply = p.first("reply/big", timeout=30)
    assert code_of(reply) == "deadline_exceeded" and "reading the message" in reply.json()["error"]
