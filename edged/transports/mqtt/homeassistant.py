"""Home Assistant MQTT discovery (opt-in: ``[mqtt.homeassistant] enabled = true``).

edged announces one Home Assistant device (``edged {device}``) and, per model, three sensors:
its state (from the retained ``.../models/{model}/state``), requests per second and p50 latency
(from the telemetry document). Every sensor is available while edged's status topic says
``online``. Configs are retained under ``{prefix}/sensor/edged_{device}/{object_id}/config``,
announced again when Home Assistant says ``online`` on ``{prefix}/status`` (its birth message),
and removed (an empty retained config, as Home Assistant documents) when a model leaves the
config: at a reload, and at start for configs a previous run left that name a model no longer
configured (edged reads its own retained configs back to find them).
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable, Iterable
from typing import Any

import orjson

from edged import __version__
from edged.config import HomeAssistantConfig

log = logging.getLogger(__name__)

Publish = Callable[[str, bytes, int, bool], object]
_UNSAFE = re.compile(r"[^a-zA-Z0-9_-]")
KINDS = ("state", "rate", "p50")


def topic_id(text: str) -> str:
    """An id for a discovery topic ([a-zA-Z0-9_-]): the text itself when already safe, else
    the text made safe plus a short digest of it, so that 'a.b' and 'a_b' stay distinct."""
    safe = _UNSAFE.sub("_", text)
    if safe == text:
        return text
    return f"{safe}_{hashlib.sha256(text.encode()).hexdigest()[:8]}"


class Discovery:
    def __init__(
        self,
        cfg: HomeAssistantConfig,
        base: str,
        device: str,
        status_topic: str,
        telemetry_topic: str,
        publish: Publish,
    ) -> None:
        self.prefix = cfg.prefix.strip("/")
        self.base = base
        self.device = device
        self.node = f"edged_{topic_id(device)}"
        self.status_topic = status_topic
        self.telemetry_topic = telemetry_topic
        self.birth_topic = f"{self.prefix}/status"
        self.config_root = f"{self.prefix}/sensor/{self.node}/"
        self._publish = publish
        self.models: set[str] = set()

    # --- topics ---

    def subscriptions(self) -> list[str]:
        """Home Assistant's birth topic, and edged's own retained configs (to find stale ones)."""
        return [self.birth_topic, f"{self.config_root}+/config"]

    def wants(self, topic: str) -> bool:
        return topic == self.birth_topic or (topic.startswith(self.config_root) and topic.endswith("/config"))

    def config_topic(self, model: str, kind: str) -> str:
        return f"{self.config_root}{self.object_id(model, kind)}/config"

    def object_id(self, model: str, kind: str) -> str:
        return f"{topic_id(model)}_{kind}"

    # --- payloads ---

    def device_doc(self) -> dict[str, Any]:
        return {
            "identifiers": [self.node],
            "name": f"edged {self.device}",
            "manufacturer": "edged",
            "model": "edged inference daemon",
            "sw_version": __version__,
        }

    def sensor(self, model: str, kind: str) -> dict[str, Any]:
        models = f"value_json.models['{model}']"  # model names are [A-Za-z0-9_.-]: no quoting needed
        specific: dict[str, Any] = {
            "state": {
                "name": f"{model} state",
                "state_topic": f"{self.base}/models/{model}/state",
                "value_template": "{{ value_json.state }}",
                "icon": "mdi:chip",
            },
            "rate": {
                "name": f"{model} requests/s",
                "state_topic": self.telemetry_topic,
                "value_template": f"{{{{ {models}.requests_per_s }}}}",
                "unit_of_measurement": "req/s",
                "state_class": "measurement",
            },
            "p50": {
                "name": f"{model} p50 latency",
                "state_topic": self.telemetry_topic,
                "value_template": f"{{{{ {models}.p50_ms }}}}",
                "unit_of_measurement": "ms",
                "device_class": "duration",
                "state_class": "measurement",
            },
        }[kind]
        return {
            **specific,
            "unique_id": f"{self.node}_{self.object_id(model, kind)}",
            "availability_topic": self.status_topic,
            "payload_available": "online",
            "payload_not_available": "offline",
            "device": self.device_doc(),
            "origin": {"name": "edged", "sw_version": __version__},
        }

    # --- announcing ---

    def announce(self, models: Iterable[str]) -> None:
        """Publish every current model's sensors; remove those of models no longer there."""
        current = set(models)
        for gone in sorted(self.models - current):
            self.remove(gone)
        self.models = current
        for model in sorted(current):
            for kind in KINDS:
                self._publish(self.config_topic(model, kind), orjson.dumps(self.sensor(model, kind)), 1, True)

    def update(self, models: Iterable[str]) -> None:
        """After a reload: announce models that came, remove those that left."""
        current = set(models)
        if current != self.models:
            self.announce(current)

    def remove(self, model: str) -> None:
        for kind in KINDS:
            self._publish(self.config_topic(model, kind), b"", 1, True)
        log.info("Home Assistant: removed the sensors of %s", model, extra={"model": model})

    def on_message(self, topic: str, payload: bytes) -> None:
        if topic == self.birth_topic:
            if payload.strip() == b"online":
                log.info("Home Assistant is online: announcing %d models", len(self.models))
                self.announce(self.models)
            return
        if not payload:
            return  # a removal (ours, echoed back)
        object_id = topic[len(self.config_root) : -len("/config")]
        wanted = {self.object_id(m, k) for m in self.models for k in KINDS}
        if object_id not in wanted:  # left by an earlier run for a model that is gone
            self._publish(topic, b"", 1, True)
            log.info("Home Assistant: removed stale sensor %s", object_id)
