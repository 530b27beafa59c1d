"""MQTT: the same models, validation and errors as the socket, for sensors and apps that only
speak MQTT (design section 4; topics and payloads in docs/mqtt.md).

paho-mqtt is driven by the event loop (link.py says why); paho's callbacks never block,
they start a task (requests.py) that reads the request, off the loop when it is large,
hands it to ``service.infer`` like a socket request and publishes the reply. The transport
knows nothing of backends.

Reliability: with MQTT 5 the session is persistent (clean start off, a session expiry), so QoS 1
requests sent while edged was briefly away are delivered when it reconnects. A message is
acknowledged once answered or dropped, in arrival order; a redelivery of one that an earlier run
never answered is dropped and counted, never run again (acks.py). Retained requests are
ignored: MQTT 5 subscriptions ask for the retain flag as published and no retained messages at
subscription time.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

import paho.mqtt.client as mqtt
from paho.mqtt.subscribeoptions import SubscribeOptions

from edged.config import MqttConfig
from edged.errors import ConfigError
from edged.serving.states import ModelState
from edged.transports.mqtt import codec
from edged.transports.mqtt.homeassistant import Discovery
from edged.transports.mqtt.link import Link
from edged.transports.mqtt.requests import Requests
from edged.transports.mqtt.telemetry import Telemetry

if TYPE_CHECKING:
    from edged.serving.service import Service

log = logging.getLogger(__name__)

# start() waits for the first connect attempt's outcome, at most this long, so that the retained
# states of the boot go out as they happen. A broker that refuses or is down costs nothing more;
# edged never fails to start for want of a broker, it keeps reconnecting in the background.
FIRST_CONNECT_WAIT_S = 2.0
OFFLINE_FLUSH_S = 2.0


def _check_topic_part(value: str, key: str) -> None:
    if not value or any(c in value for c in "+#\0") or value.startswith("$"):
        raise ConfigError(f"mqtt.{key}: {value!r} cannot be part of an MQTT topic")


class MqttTransport:
    """Device requests arrive on a persistent session (``edged-{device}``); with a fleet group,
    fleet requests arrive on a second connection whose session ends with it
    (``edged-{device}-fleet``), so a device that dies stops taking a share of the fleet's
    requests at once instead of queueing them at the broker until its session expires."""

    def __init__(self, cfg: MqttConfig, service: Service, loop: asyncio.AbstractEventLoop) -> None:
        self.cfg = cfg
        self.service = service
        self.loop = loop
        self.device = cfg.device_id or socket.gethostname()
        self.prefix = cfg.topic_prefix.strip("/")
        _check_topic_part(self.prefix, "topic_prefix")
        _check_topic_part(self.device, "device_id")
        if "/" in self.device or self.device == "fleet":
            raise ConfigError(f"mqtt.device_id: {self.device!r} cannot name a device in a topic")
        if cfg.fleet_group:
            _check_topic_part(cfg.fleet_group, "fleet_group")
        self.base = f"{self.prefix}/{self.device}"
        self.status_topic = f"{self.base}/status"
        self.telemetry_topic = f"{self.base}/telemetry"
        self.v5 = cfg.protocol == "5"
        self._stopped = False
        self._fleet: set[str] = set()
        self._telemetry: asyncio.Task[None] | None = None
        self.requests = Requests(cfg, service, loop, self.base)
        self.stats = Telemetry(service, self.device)
        self.link = Link(
            cfg,
            loop,
            f"edged-{self.device}",
            True,
            self._connected,
            self._on_message,
            will_topic=self.status_topic,
            journal_dir=Path(service.registry.cfg.cache.dir) / "mqtt",
        )
        self.fleet_link: Link | None = None
        if cfg.fleet_group:
            self.fleet_link = Link(
                cfg, loop, f"edged-{self.device}-fleet", False, self._fleet_connected, self._on_message
            )
        self.client = self.link.client
        self.connected = self.link.connected
        self.discovery: Discovery | None = None
        if cfg.homeassistant.enabled:
            _check_topic_part(cfg.homeassistant.prefix.strip("/"), "homeassistant.prefix")
            if not cfg.telemetry_interval_s:
                raise ConfigError("mqtt.homeassistant: its rate and latency sensors need mqtt.telemetry_interval_s > 0")
            self.discovery = Discovery(
                cfg.homeassistant, self.base, self.device, self.status_topic, self.telemetry_topic, self._publish
            )

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        for rt in self.service.registry.models.values():
            self._track_fleet(rt.name, rt.state)
        self.link.start()
        if self.fleet_link is not None:
            self.fleet_link.start()
        try:
            await asyncio.wait_for(self.link.attempted.wait(), FIRST_CONNECT_WAIT_S)
        except asyncio.TimeoutError:
            pass
        if not self.connected.is_set():
            log.warning(
                "MQTT broker %s:%d is not reachable yet; retrying in the background", self.cfg.host, self.cfg.port
            )
        if self.cfg.telemetry_interval_s:
            self._telemetry = self.loop.create_task(self._telemetry_loop())

    async def stop(self) -> None:
        """Leave the fleet, finish what was accepted, publish 'offline', disconnect. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._telemetry is not None:
            self._telemetry.cancel()
        if self.fleet_link is not None:
            await self.fleet_link.stop()
        await self.requests.drain(self.service.registry.cfg.lifecycle.drain_timeout_s)
        if self.connected.is_set():
            info = self.link.publish(self.status_topic, b"offline", qos=max(1, self.cfg.qos), retain=True)
            try:
                if info is not None:  # the loop keeps running paho while a thread waits
                    await asyncio.to_thread(info.wait_for_publish, OFFLINE_FLUSH_S)
            except (RuntimeError, ValueError) as e:
                log.warning("MQTT: could not publish 'offline': %s", e)
        await self.link.stop()
        log.info("MQTT disconnected")

    def _connected(self, session_present: bool) -> None:
        """Subscribe, then announce: the broker handles a client's packets in order, so whoever
        sees 'online' can send a request at once."""
        self.client.subscribe(f"{self.base}/models/+/infer", **self._request_options())
        self.client.subscribe(f"{self.base}/models/+/generate", **self._request_options())  # language models
        self.link.publish(self.status_topic, b"online", qos=self.cfg.qos, retain=True)
        for rt in self.service.registry.models.values():
            self._publish_state(rt.name, rt.state, rt.reason)
        if self.discovery is not None:
            self.discovery.announce(self.service.registry.models)
            for topic in self.discovery.subscriptions():
                opts = SubscribeOptions(qos=1, noLocal=True) if self.v5 else None
                self.client.subscribe(topic, **({"options": opts} if opts else {"qos": 1}))
        log.info(
            "MQTT connected to %s:%d as device %s (%s)",
            self.cfg.host,
            self.cfg.port,
            self.device,
            "session resumed" if session_present else "new session",
        )

    def _fleet_connected(self, session_present: bool) -> None:
        assert self.fleet_link is not None
        for model in sorted(self._fleet):
            self.fleet_link.client.subscribe(self._fleet_topic(model), **self._request_options())
        log.info(
            "MQTT fleet group %s: taking requests for %s",
            self.cfg.fleet_group,
            ", ".join(sorted(self._fleet)) or "no model yet",
        )

    # --- model state and fleet --------------------------------------------------------------------

    def _request_options(self) -> dict[str, Any]:
        """MQTT 5: the retain flag as published (a retained request is told apart even when
        forwarded live) and no retained messages at subscription time. MQTT 3.1.1 brokers clear
        the flag on live forwards, so only a replayed retained request is recognised there."""
        if not self.v5:
            return {"qos": self.cfg.qos}
        return {"options": SubscribeOptions(qos=self.cfg.qos, retainAsPublished=True, retainHandling=2)}

    def _publish(self, topic: str, payload: bytes, qos: int, retain: bool) -> None:
        if self.connected.is_set():
            self.link.publish(topic, payload, qos=qos, retain=retain)

    def model_state(self, rt: Any) -> None:
        """Called on the loop at each model state change (rt: registry.ModelRuntime)."""
        self._track_fleet(rt.name, rt.state, subscribe=True)
        if self.connected.is_set():
            self._publish_state(rt.name, rt.state, rt.reason)
            self.models_changed()

    def models_changed(self) -> None:
        """After a reload (or any state change): Home Assistant sensors follow the models."""
        if self.discovery is not None and self.connected.is_set():
            self.discovery.update(self.service.registry.models)

    def _publish_state(self, name: str, state: ModelState, reason: str) -> None:
        self.link.publish(
            f"{self.base}/models/{name}/state",
            codec.model_state_doc(name, state, reason),
            qos=self.cfg.qos,
            retain=True,
        )

    def _fleet_topic(self, model: str) -> str:
        return f"$share/{self.cfg.fleet_group}/{self.prefix}/fleet/models/{model}/infer"

    def _track_fleet(self, name: str, state: ModelState, subscribe: bool = False) -> None:
        """Take a share of a model's fleet requests while it serves, give it back when it is out of
        service (failed, deferred, unloaded); the steps between (loading, warming...) change nothing."""
        if not self.cfg.fleet_group:
            return
        link = self.fleet_link
        live = subscribe and link is not None and link.connected.is_set()
        if state.serving and name not in self._fleet:
            self._fleet.add(name)
            if live:
                assert link is not None
                link.client.subscribe(self._fleet_topic(name), **self._request_options())
        elif state.out_of_service and name in self._fleet:
            self._fleet.discard(name)
            if live:
                assert link is not None
                link.client.unsubscribe(self._fleet_topic(name))

    # --- messages ------------------------------------------------------------------------------

    def _on_message(self, link: Link, msg: mqtt.MQTTMessage) -> None:
        """paho's callback, on the loop: Home Assistant's topics here, requests elsewhere."""
        try:
            try:
                topic = msg.topic
            except UnicodeDecodeError:  # not ours: the requests side answers and acknowledges it
                topic = ""
            if self.discovery is not None and link is self.link and self.discovery.wants(topic):
                d = link.deliveries.receive(topic, msg.mid, msg.qos, False, len(msg.payload), 0)
                try:
                    self.discovery.on_message(topic, bytes(msg.payload))
                finally:
                    link.deliveries.finish(d)
                return
            self.requests.on_message(link, msg)
        except Exception:  # a message edged cannot even read must not stop the next one
            log.exception("MQTT: cannot handle message %d", msg.mid)

    # --- telemetry ------------------------------------------------------------------------------

    async def _telemetry_loop(self) -> None:
        interval = self.cfg.telemetry_interval_s
        while True:
            await asyncio.sleep(interval)
            if not self.connected.is_set():
                continue
            try:
                doc = await self.stats.document()
            except Exception:  # telemetry must never take the transport down
                log.exception("MQTT: telemetry failed")
                continue
            self.link.publish(self.telemetry_topic, codec.dumps(doc), qos=0)
