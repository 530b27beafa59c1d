"""An MQTT request that fails to decode is answered without stalling the event loop, also when it
carries no 'id' user property (finding where its error goes parses the payload once more), against
a real mosquitto."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import HealthProber
from tests.integration.mosquitto import Broker, Peer, broker
from tests.integration.mqtt_daemon import Edged, code_of
from tests.integration.test_mqtt_poison import TOPIC, tiny

pytestmark = pytest.mark.integration
__all__ = ["broker", "tiny"]  # fixtures: imported so that pytest finds them

# Malformed JSON that holds NaN: strict parsing fails, then the lenient reader that accepts NaN
# and Infinity reads all of it, slowly, before failing too (6.5 MB, within server.max_json).
UNREADABLE = b'{"inputs": [{"name": "x", "shape": [1, 16], "datatype": "FP32", "data": [' + b"NaN, " * 1_300_000


def test_an_undecodable_body_without_an_id_does_not_stall_the_loop(
    broker: Broker, tiny: dict[str, Any], tmp_path: Path, daemons: list[Edged]
) -> None:
    d = Edged(tmp_path / "edge", broker.port, "dev-p", tiny, tmp_path / "cache")
    d.start()
    daemons.append(d)
    with Peer(broker.port) as p, HealthProber(d.socket).running() as probe:
        p.subscribe("reply/u")
        sent = time.perf_counter()
        p.request(TOPIC, UNREADABLE, "reply/u", b"unreadable")  # MQTT 5, no 'id' user property
        reply = p.first("reply/u", timeout=120)
        took = time.perf_counter() - sent
    assert reply.correlation == b"unreadable" and code_of(reply) == "bad_request", reply.payload[:300]
    # The loop answered health checks all along: the slowest waited a small part of the time
    # the request took to be read and refused.
    assert probe.count > 0 and probe.worst < took / 4, f"a health check waited {probe.worst:.3f} s of {took:.3f} s"
