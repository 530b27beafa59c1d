"""Home Assistant MQTT discovery against a real mosquitto: the discovery payloads, the
re-announcement on Home Assistant's birth message, and removal when a model leaves the config."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edged.tools.demo import make_tiny_mlp
from edged.transports.mqtt.homeassistant import topic_id
from tests.integration.mosquitto import Broker, Peer, Received, broker
from tests.integration.mqtt_daemon import Edged, code_of, json_request

pytestmark = pytest.mark.integration
__all__ = ["broker"]  # a fixture: imported so that pytest finds it

DEV = "dev-h"
ROOT = f"homeassistant/sensor/edged_{DEV}"
X = np.zeros((1, 16), np.float32)


def configs(peer: Peer) -> dict[str, Received]:
    """The latest config per discovery topic (an empty payload is a removal)."""
    with peer.cond:
        return {r.topic: r for r in peer.received if r.topic.startswith(ROOT) and r.topic.endswith("/config")}


def evaluate(template: str, doc: Any) -> Any:
    """The two template forms edged writes: ``value_json.a`` and ``value_json.models['m'].k``."""
    m = re.fullmatch(r"\{\{ value_json((?:\.\w+|\['[\w.-]+'\])+) \}\}", template)
    assert m, template
    for part in re.findall(r"\.(\w+)|\['([\w.-]+)'\]", m.group(1)):
        doc = doc[part[0] or part[1]]
    return doc


def test_discovery_announces_reannounces_and_removes(broker: Broker, tmp_path: Path) -> None:
    path = str(make_tiny_mlp(tmp_path / "tiny.onnx"))
    models: dict[str, dict[str, Any]] = {"tiny": {"path": path}, "b.1": {"path": path}}
    with Peer(broker.port) as p:
        # Left by an earlier run for a model that is no longer configured.
        p.client.publish(f"{ROOT}/gone_state/config", b'{"name": "gone"}', qos=1, retain=True).wait_for_publish(5)
        p.subscribe("homeassistant/#")
        p.subscribe(f"edged/{DEV}/telemetry", qos=0)
        p.subscribe("reply/ha")
        d = Edged(
            tmp_path / "edge",
            broker.port,
            DEV,
            models,
            tmp_path / "cache",
            telemetry_interval_s=1,
            homeassistant={"enabled": True},
        )
        d.start()
        try:
            b1 = topic_id("b.1")
            assert b1.startswith("b_1_") and b1 != "b_1"  # '.' is not allowed in a topic id
            wanted = {f"{ROOT}/{m}_{k}/config" for m in ("tiny", b1) for k in ("state", "rate", "p50")}
            p.wait(lambda: wanted <= set(configs(p)), 20, "six sensor configs")
            docs = {t: r.json() for t, r in configs(p).items() if t in wanted}
            assert len({doc["unique_id"] for doc in docs.values()}) == 6
            for doc in docs.values():
                assert doc["availability_topic"] == f"edged/{DEV}/status"
                assert (doc["payload_available"], doc["payload_not_available"]) == ("online", "offline")
                assert doc["device"]["identifiers"] == [f"edged_{DEV}"] and doc["device"]["name"] == f"edged {DEV}"
            state = docs[f"{ROOT}/tiny_state/config"]
            assert state["state_topic"] == f"edged/{DEV}/models/tiny/state"
            p.subscribe(state["state_topic"])
            assert evaluate(state["value_template"], p.first(state["state_topic"]).json()) == "ready"
            # The templates read what edged publishes.
            p.request(f"edged/{DEV}/models/tiny/infer", json_request(X), "reply/ha", b"1")
            assert code_of(p.first("reply/ha")) == "ok"
            tele = p.first(
                f"edged/{DEV}/telemetry", lambda r: r.json()["models"]["tiny"]["requests"] > 0, timeout=10
            ).json()
            rate, p50 = docs[f"{ROOT}/tiny_rate/config"], docs[f"{ROOT}/tiny_p50/config"]
            assert rate["state_topic"] == p50["state_topic"] == f"edged/{DEV}/telemetry"
            assert isinstance(evaluate(rate["value_template"], tele), (int, float))
            assert evaluate(p50["value_template"], tele) > 0 and p50["unit_of_measurement"] == "ms"
            # No request yet: no latency (rendered "None", which Home Assistant shows as unknown).
            assert evaluate(docs[f"{ROOT}/{b1}_p50/config"]["value_template"], tele) is None
            # The stale config was removed.
            p.wait(lambda: configs(p)[f"{ROOT}/gone_state/config"].payload == b"", 10, "the stale config removed")
            # Home Assistant restarts: announced again.
            before = len(p.on(f"{ROOT}/tiny_state/config"))
            p.client.publish("homeassistant/status", b"online", qos=1)
            p.wait(lambda: len(p.on(f"{ROOT}/tiny_state/config")) > before, 10, "the re-announcement")
            # A model leaves the config: its sensors are removed at the reload.
            d.write_models({"tiny": models["tiny"]})
            assert d.proc is not None
            os.kill(d.proc.pid, signal.SIGHUP)
            gone = {f"{ROOT}/{b1}_{k}/config" for k in ("state", "rate", "p50")}
            p.wait(lambda: all(configs(p)[t].payload == b"" for t in gone), 20, "b.1's sensors removed")
        finally:
            assert d.stop() == 0
    with Peer(broker.port) as late:  # what Home Assistant finds when it subscribes now
        late.subscribe(f"{ROOT}/+/config")
        late.wait(lambda: len(configs(late)) >= 3, 10, "the retained configs")
        assert {t for t, r in configs(late).items() if r.payload} == {
            f"{ROOT}/tiny_{k}/config" for k in ("state", "rate", "p50")
        }
        assert all(json.loads(r.payload)["device"]["identifiers"] == [f"edged_{DEV}"] for r in configs(late).values())
