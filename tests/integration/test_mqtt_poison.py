"""MQTT cannot poison the session (issue 10): against a real mosquitto that redelivers.

Before: a request that stalled edged's event loop past the broker keep-alive was acknowledged on
arrival but the ack never left; the broker dropped edged, redelivered the request at every
reconnect, and edged froze again, at every restart too, until its session was cleared by hand.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edged.tools.demo import make_tiny_mlp
from tests.helpers import wait_for
from tests.integration.mosquitto import Broker, Peer, broker
from tests.integration.test_mqtt import Edged, code_of, json_request

pytestmark = pytest.mark.integration
__all__ = ["broker"]  # a fixture: imported so that pytest finds it

X = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)
TOPIC = "edged/dev-p/models/tiny/infer"
# 50,000 user properties (350 KB): paho's own reader took 8.2 s over them on the event loop.
BOMB_PROPERTIES = 50_000


@pytest.fixture
def tiny(tmp_path: Path) -> dict[str, dict[str, Any]]:
    return {"tiny": {"path": str(make_tiny_mlp(tmp_path / "tiny.onnx"))}}


class HealthProbe:
    """Asks /v2/health/live over the socket in a loop and keeps the slowest answer."""

    def __init__(self, edge: Edged) -> None:
        self.edge = edge
        self.worst = 0.0
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with self.edge.client(timeout=60) as c:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                status, _, _ = c.request("GET", "/v2/health/live")
                assert status == 200
                self.worst = max(self.worst, time.perf_counter() - t0)
                self.count += 1
                self._stop.wait(0.01)  # a probe every ~10 ms, not a synchronisation

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def test_a_property_bomb_neither_freezes_edged_nor_comes_back(
    broker: Broker, tiny: dict[str, Any], tmp_path: Path, daemons: list[Edged]
) -> None:
    # A 2 s keep-alive: a loop stalled for 3 s loses the connection (the broker allows 1.5x).
    d = Edged(tmp_path / "edge", broker.port, "dev-p", tiny, tmp_path / "cache", keepalive_s=2)
    d.start()
    daemons.append(d)
    with Peer(broker.port) as p, HealthProbe(d) as probe:
        p.subscribe("reply/bomb")
        p.request(TOPIC, json_request(X, "bomb"), "reply/bomb", b"bomb", user=[("k", "v")] * BOMB_PROPERTIES)
        reply = p.first("reply/bomb", timeout=60)
        assert code_of(reply) == "ok" and reply.json()["id"] == "bomb"
        # Later traffic is answered after it; nothing was redelivered or answered twice.
        p.request(TOPIC, json_request(X, "after"), "reply/bomb", b"after")
        p.wait(lambda: b"after" in p.replies("reply/bomb"), 30, "the next request's answer")
        probes = probe.count
    assert sum(r.correlation == b"bomb" for r in p.on("reply/bomb")) == 1
    assert "connection to" not in d.log(), d.log()[-3000:]  # never dropped by the broker
    assert d.metric("edged_dropped_total", model="tiny", reason="duplicate") == 0
    assert probes > 0 and probe.worst < 0.5, f"health check stalled {probe.worst:.3f} s"


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
        # The test-only fault switch: while the file exists, a worker that takes a request hangs
        # (it is polled by the watchdog loop, which runs when WATCHDOG_USEC is set).
        env={"EDGED_TEST_WEDGE": str(wedge), "WATCHDOG_USEC": "200000"},
    )
    d.start()
    daemons.append(d)
    journal = tmp_path / "cache" / "mqtt" / "edged-dev-p.running"
    with Peer(broker.port) as p:
        p.subscribe("reply/poison")
        wedge.touch()

        def wedged() -> bool:
            """Send a request; True once one hangs (the watchdog loop applies the switch)."""
            n = len(p.on("reply/poison"))
            p.request(TOPIC, json_request(X, "poison"), "reply/poison", b"poison")
            time.sleep(0.5)  # no answer within this long, on a tiny model, means it hangs
            return len(p.on("reply/poison")) == n

        wait_for(wedged, 20, interval=0, what="a request to hang")
        wait_for(lambda: journal.read_bytes().strip(b"\0"), 5, what="the hanging request in the journal")
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
