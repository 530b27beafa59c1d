"""The fleet as the broker shows it: every device's retained state and desired override, the
group's desired state and the rollout's progress, kept current by one MQTT connection (paho's
network thread; readers wait on a condition). The controller and ``edged fleet status`` use it;
it talks to nothing but the broker.

Every message is untrusted: a state over ``MAX_STATE_BYTES`` or that is not a JSON object is
ignored, and devices are keyed by the topic they published on (not by what their payload claims).
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

from edged.fleet import protocol

log = logging.getLogger(__name__)

MAX_STATE_BYTES = 256 * 1024


@dataclass(frozen=True)
class BrokerAddress:
    host: str = "localhost"
    port: int = 1883
    username: str = ""
    password: str = ""
    ca: str = ""
    cert: str = ""
    key: str = ""


def _json(payload: bytes) -> dict[str, Any] | None:
    if not payload or len(payload) > MAX_STATE_BYTES:
        return None
    try:
        doc = json.loads(payload)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


class FleetView:
    def __init__(self, address: BrokerAddress, prefix: str, group: str) -> None:
        self.prefix, self.group = prefix.strip("/"), protocol.topic_part(group, "--group")
        self.cond = threading.Condition()
        self.states: dict[str, dict[str, Any]] = {}  # device -> its state (of this group)
        self.overrides: dict[str, dict[str, Any]] = {}  # device -> its desired override
        self.group_desired: dict[str, Any] | None = None
        self.rollout_status: dict[str, Any] | None = None
        self.connects = 0
        self.last_message = 0.0
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=f"edged-fleet-{uuid.uuid4().hex[:12]}",
            protocol=MQTTProtocolVersion.MQTTv5,
        )
        self.client.reconnect_delay_set(1, 30)
        if address.username:
            self.client.username_pw_set(address.username, address.password or None)
        if address.ca or address.cert:
            self.client.tls_set(
                ca_certs=address.ca or None,
                certfile=address.cert or None,
                keyfile=address.key or None,
                cert_reqs=ssl.CERT_REQUIRED,
            )
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.address = address

    def __enter__(self) -> FleetView:
        self.client.connect_async(self.address.host, self.address.port, 30)
        self.client.loop_start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.disconnect()
        self.client.loop_stop()

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        if reason.is_failure:
            log.error("the broker refused the connection: %s", reason)
            return
        # After a reconnect too: a clean session forgets subscriptions, and the retained
        # messages come again, so nothing published while the broker was away is missed.
        p = self.prefix
        for topic in (
            protocol.all_states(p),
            f"{p}/+/fleet/desired",
            protocol.group_desired(p, self.group),
            protocol.rollout(p, self.group),
        ):
            client.subscribe(topic, qos=1)
        with self.cond:
            self.connects += 1
            self.last_message = time.monotonic()  # the retained messages are on their way
            self.cond.notify_all()

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        doc = _json(bytes(msg.payload))
        topic = msg.topic
        parts = topic.split("/")
        with self.cond:
            self.last_message = time.monotonic()
            device = protocol.device_of_state(self.prefix, topic)
            if device is not None:
                if doc is not None and doc.get("group") == self.group:
                    self.states[device] = doc
                else:  # cleared, unreadable, or a device of another group
                    self.states.pop(device, None)
            elif topic == protocol.group_desired(self.prefix, self.group):
                self.group_desired = doc
            elif topic == protocol.rollout(self.prefix, self.group):
                self.rollout_status = doc
            elif len(parts) >= 3 and parts[-2:] == ["fleet", "desired"] and protocol.NAME_RE.match(parts[-3]):
                if doc is None:
                    self.overrides.pop(parts[-3], None)
                else:
                    self.overrides[parts[-3]] = doc
            self.cond.notify_all()

    # --- waiting -------------------------------------------------------------------------------

    def wait(self, pred: Callable[[], Any], timeout: float) -> Any:
        with self.cond:
            return self.cond.wait_for(pred, timeout)

    def wait_connected(self, timeout: float) -> bool:
        return bool(self.wait(lambda: self.connects > 0, timeout))

    def wait_quiet(self, quiet_s: float, timeout: float) -> None:
        """Until no message came for ``quiet_s`` (the retained ones have all arrived)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while time.monotonic() < deadline:
                idle = time.monotonic() - self.last_message
                if self.connects and idle >= quiet_s:
                    return
                self.cond.wait(max(0.01, min(quiet_s - idle, deadline - time.monotonic())))

    def snapshot(self) -> dict[str, dict[str, Any]]:
        with self.cond:
            return dict(self.states)

    def publish(self, topic: str, payload: bytes, retain: bool = True) -> mqtt.MQTTMessageInfo:
        """QoS 1: paho keeps it and sends it again after a reconnect until the broker has it."""
        return self.client.publish(topic, payload, qos=1, retain=retain)
