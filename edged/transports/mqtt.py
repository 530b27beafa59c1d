"""MQTT: the same models, validation and errors as the socket, for sensors and apps that only
speak MQTT (design section 4; topics and payloads in docs/mqtt.md).

paho-mqtt is driven by the event loop (mqtt_link.py says why): a request is read, handed to
``service.infer`` like a socket request, and its reply written, all on the loop; paho's
callbacks never block, they start a task. The transport knows nothing of backends.

Reliability: with MQTT 5 the session is persistent (clean start off, a session expiry), so QoS 1
requests sent while edged was briefly away are delivered when it reconnects. Messages are
acknowledged by hand, in order, as they arrive, except once edged is stopping: those stay
unacknowledged and the broker hands them to the next start.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import TYPE_CHECKING, Any

import paho.mqtt.client as mqtt

from edged.config import MqttConfig
from edged.errors import BusyError, ConfigError, EdgedError, InvalidInputError, ModelNotReadyError
from edged.transports import mqtt_codec as codec
from edged.transports import mqtt_generate
from edged.transports.mqtt_link import Link
from edged.transports.mqtt_telemetry import telemetry

if TYPE_CHECKING:
    from edged.service import Service

log = logging.getLogger(__name__)

# Registry state names (part of the status API). A model in the first set takes fleet requests;
# one in the second gives its share back; other states (loading, warming...) are transitions.
SERVING = frozenset({"ready", "lazy"})
NOT_SERVING = frozenset({"failed", "deferred"})

# start() waits for the first connect attempt's outcome, at most this long, so that the retained
# states of the boot go out as they happen. A broker that refuses or is down costs nothing more;
# edged never fails to start for want of a broker, it keeps reconnecting in the background.
FIRST_CONNECT_WAIT_S = 2.0
OFFLINE_FLUSH_S = 2.0


def _check_topic_part(value: str, key: str) -> None:
    if not value or any(c in value for c in "+#\0") or value.startswith("$"):
        raise ConfigError(f"mqtt.{key}: {value!r} cannot be part of an MQTT topic")


def incoming(msg: mqtt.MQTTMessage) -> codec.Incoming:
    """What the request's task needs of paho's message."""
    payload = msg.payload if isinstance(msg.payload, bytes) else bytes(msg.payload)
    inc = codec.Incoming(msg.topic, payload, msg.qos, time.monotonic())
    props = msg.properties
    if props is not None:
        inc.response_topic = getattr(props, "ResponseTopic", "")
        inc.correlation = getattr(props, "CorrelationData", None)
        inc.content_type = getattr(props, "ContentType", "")
        inc.user = dict(getattr(props, "UserProperty", ()))
        inc.expiry_s = getattr(props, "MessageExpiryInterval", None)
    return inc


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
        self.closing = False  # from then on nothing more is acknowledged
        self._stopped = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._fleet: set[str] = set()
        self._telemetry: asyncio.Task[None] | None = None
        self.link = Link(
            cfg, loop, f"edged-{self.device}", True, self._connected, self._on_message, will_topic=self.status_topic
        )
        self.fleet_link: Link | None = None
        if cfg.fleet_group:
            self.fleet_link = Link(
                cfg, loop, f"edged-{self.device}-fleet", False, self._fleet_connected, self._on_message
            )
        self.client = self.link.client
        self.connected = self.link.connected

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
        self.closing = True
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self.service.registry.cfg.lifecycle.drain_timeout_s)
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
        self.client.subscribe(f"{self.base}/models/+/infer", self.cfg.qos)
        self.client.subscribe(f"{self.base}/models/+/generate", self.cfg.qos)  # language models
        self.link.publish(self.status_topic, b"online", qos=self.cfg.qos, retain=True)
        for rt in self.service.registry.models.values():
            self._publish_state(rt.name, rt.state, rt.reason)
        log.info(
            "MQTT connected to %s:%d as device %s (%s)",
            self.cfg.host,
            self.cfg.port,
            self.device,
            "session resumed" if session_present else "new session",
        )

    def _fleet_connected(self, session_present: bool) -> None:
        assert self.fleet_link is not None
        topics: list[tuple[str, int]] = [(self._fleet_topic(m), self.cfg.qos) for m in sorted(self._fleet)]
        if topics:
            self.fleet_link.client.subscribe(topics)
        log.info(
            "MQTT fleet group %s: taking requests for %s",
            self.cfg.fleet_group,
            ", ".join(sorted(self._fleet)) or "no model yet",
        )

    # --- model state and fleet --------------------------------------------------------------------

    def model_state(self, rt: Any) -> None:
        """Called on the loop at each model state change (rt: registry.ModelRuntime)."""
        self._track_fleet(rt.name, rt.state, subscribe=True)
        if self.connected.is_set():
            self._publish_state(rt.name, rt.state, rt.reason)

    def _publish_state(self, name: str, state: str, reason: str) -> None:
        self.link.publish(
            f"{self.base}/models/{name}/state",
            codec.model_state_doc(name, state, reason),
            qos=self.cfg.qos,
            retain=True,
        )

    def _fleet_topic(self, model: str) -> str:
        return f"$share/{self.cfg.fleet_group}/{self.prefix}/fleet/models/{model}/infer"

    def _track_fleet(self, name: str, state: str, subscribe: bool = False) -> None:
        """Take a share of a model's fleet requests only while this device can serve it."""
        if not self.cfg.fleet_group:
            return
        link = self.fleet_link
        live = subscribe and link is not None and link.connected.is_set()
        if state in SERVING and name not in self._fleet:
            self._fleet.add(name)
            if live:
                assert link is not None
                link.client.subscribe(self._fleet_topic(name), self.cfg.qos)
        elif state in NOT_SERVING and name in self._fleet:
            self._fleet.discard(name)
            if live:
                assert link is not None
                link.client.unsubscribe(self._fleet_topic(name))

    # --- requests -------------------------------------------------------------------------------

    def _on_message(self, client: mqtt.Client, msg: mqtt.MQTTMessage) -> None:
        """Acknowledge in arrival order and start the request's task."""
        if self.closing:
            return  # left unacknowledged: the persistent session hands it to the next start
        client.ack(msg.mid, msg.qos)
        try:
            self._start_request(msg)
        except Exception:  # a message edged cannot even read must not stop the next one
            log.exception("MQTT: cannot handle message %d", msg.mid)

    def _start_request(self, msg: mqtt.MQTTMessage) -> None:
        if msg.retain or not msg.payload:
            # The broker replays a retained request at every (re)subscription: running it at
            # each reconnect would answer the same request again and again. An empty payload is
            # how a client clears such a message.
            if msg.payload:
                model = codec.model_from_topic(msg.topic, self.prefix, self.device) or ""
                log.warning("retained request on %s ignored", msg.topic, extra={"model": model, "request_id": ""})
            return
        self._accept(incoming(msg))

    def _accept(self, inc: codec.Incoming) -> None:
        generate = inc.topic.endswith(mqtt_generate.SUFFIX)
        task = self.loop.create_task(mqtt_generate.handle(self, inc) if generate else self._handle(inc))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle(self, inc: codec.Incoming) -> None:
        model = codec.model_from_topic(inc.topic, self.prefix, self.device)
        if model is None:
            log.debug("MQTT: ignoring a message on %s", inc.topic)
            return
        extra = {"model": model, "request_id": codec.request_id(inc)}
        if inc.expired():
            self._drop(model, "expired", extra)
            return
        try:
            dec = codec.decode(inc)
        except EdgedError as e:
            self._undecodable(inc, model, e, extra)
            return
        if dec.request.id:
            extra["request_id"] = dec.request.id
        if not dec.reply_to:
            log.warning("%s: request without a Response Topic or 'reply_to' dropped", model, extra=extra)
            self._drop(model, "no_reply_to", extra)
            return
        reply = await self._answer(model, dec, extra)
        if inc.expired():  # the requester gave up while it ran: an answer would be noise
            self._drop(model, "expired", extra)
            return
        self._publish_reply(inc, dec.reply_to, reply, extra)

    async def _answer(self, model: str, dec: codec.Decoded, extra: dict[str, str]) -> codec.Reply:
        try:
            inputs = dec.request.inputs
            if dec.raw:
                assert dec.raw_tensor is not None
                inputs = {dec.input_name or await self._single_input(model): dec.raw_tensor}
            results = await self.service.infer(model, inputs, extra["request_id"], transport="mqtt")
            return codec.ok_reply(model, dec, results)
        except BusyError as e:
            self.service.metrics.dropped.labels(model, "busy").inc()
            return codec.error_reply(e, dec.request.id)
        except EdgedError as e:
            return codec.error_reply(e, dec.request.id)
        except Exception as e:  # a bug must answer, never leave the requester waiting
            log.exception("%s: request failed", model, extra=extra)
            return codec.error_reply(EdgedError(f"internal error: {e}"), dec.request.id)

    async def _single_input(self, model: str) -> str:
        """The input a raw tensor goes to when the request does not name one."""
        rt = self.service.model(model)
        if not rt.inputs:
            # Inputs are known once the model is loaded: wait for readiness as service.infer
            # would, then load a lazy model, so raw requests need no name even on first use.
            timeout = self.service.registry.cfg.server.request_timeout_ms / 1000
            try:
                await asyncio.wait_for(self.service.ready.wait(), timeout)
            except asyncio.TimeoutError:
                raise ModelNotReadyError("edged is still starting") from None
            await self.service.load(model)
        if len(rt.inputs) != 1:
            names = ", ".join(s.name for s in rt.inputs)
            raise InvalidInputError(
                f"model '{model}' takes inputs [{names}]: name the raw tensor's input with the "
                "'input' user property, or send JSON for several inputs"
            )
        return str(rt.inputs[0].name)

    def _undecodable(self, inc: codec.Incoming, model: str, err: EdgedError, extra: dict[str, str]) -> None:
        reply_to, rid = inc.response_topic, ""
        if not inc.raw:
            json_reply_to, rid = codec.reply_to_of(inc.payload)
            reply_to = reply_to or json_reply_to
        if not reply_to:
            log.warning("%s: unreadable request without a reply topic dropped: %s", model, err.message, extra=extra)
            self._drop(model, "no_reply_to", extra)
            return
        log.debug("%s: bad request: %s", model, err.message, extra=extra)
        self._publish_reply(inc, reply_to, codec.error_reply(err, rid), extra)

    def _publish_reply(self, inc: codec.Incoming, topic: str, reply: codec.Reply, extra: dict[str, str]) -> None:
        props = None
        if self.v5:
            props = codec.PackedProperties(
                codec.pack_properties(reply.content_type, inc.correlation, [("device", self.device), *reply.user])
            )
        try:
            self.link.publish(topic, reply.payload, qos=inc.qos, properties=props)
        except ValueError as e:  # a response topic with wildcards, or empty
            log.warning("cannot reply on %r: %s", topic, e, extra=extra)

    def _drop(self, model: str, reason: str, extra: dict[str, str]) -> None:
        # Label only configured models: a typo in a topic must not grow the metrics forever.
        label = model if model in self.service.registry.models else "_unknown"
        self.service.metrics.dropped.labels(label, reason).inc()
        log.info("%s: request dropped (%s)", model, reason, extra=extra)

    # --- telemetry ------------------------------------------------------------------------------

    async def _telemetry_loop(self) -> None:
        interval = self.cfg.telemetry_interval_s
        while True:
            await asyncio.sleep(interval)
            if not self.connected.is_set():
                continue
            try:
                doc = await telemetry(self.service, self.device)
            except Exception:  # telemetry must never take the transport down
                log.exception("MQTT: telemetry failed")
                continue
            self.link.publish(self.telemetry_topic, codec.dumps(doc), qos=0)
