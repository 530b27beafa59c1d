"""MQTT requests: from a PUBLISH to a reply or a counted drop, and then its acknowledgement.

paho's callback does O(1) work on the loop: it records the delivery (acks.py decides whether
it runs) and starts a task. The task reads the properties and payload (in a worker thread when the
message is large, offload.py), hands the request to ``service.infer`` like a socket request,
publishes the reply, and only then lets the message be acknowledged. Every request ends in
exactly one of: a reply, or a drop counted in ``edged_dropped_total{reason=...}``; the message is
acknowledged after either, never before: a message that fails cannot come back forever.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import paho.mqtt.client as mqtt

from edged.config import MqttConfig, max_body_bytes
from edged.errors import (
    BusyError,
    DeadlineExceededError,
    EdgedError,
    InvalidInputError,
    ModelNotFoundError,
    ModelNotReadyError,
    ShuttingDownError,
)
from edged.ratelog import RateLimitedLog
from edged.transports.mqtt import codec
from edged.transports.mqtt import generate as mqtt_generate
from edged.transports.mqtt.acks import Delivery, Verdict
from edged.transports.mqtt.offload import Offload
from edged.transports.mqtt.props import LazyPublishProperties, vbi
from edged.wire import tensors

if TYPE_CHECKING:
    from edged.serving.service import Service
    from edged.transports.mqtt.link import Link

log = logging.getLogger(__name__)

# Decoding walks the whole message (about 1 ms per 100-300 KB of JSON on a small board): above
# this size it runs in a worker thread, below it the hand-off would cost more than the work.
OFFLOAD_BYTES = 32 * 1024
PROPS_ON_LOOP = 4 * 1024  # property blocks up to this are parsed on the loop (tens of microseconds)
OFFLOAD_WORKERS = 2
# Messages held beyond max_inflight, as a multiple of it, before more are dropped ('overloaded').
WAITING_FACTOR = 16


def property_block(msg: mqtt.MQTTMessage) -> bytes:
    """The raw MQTT 5 property block of a PUBLISH (props.py keeps it unparsed)."""
    props = msg.properties
    if props is None:
        return b""
    if isinstance(props, LazyPublishProperties):
        return props.raw
    packed = props.pack()  # paho's own class: only if the lazy one could not be installed
    return bytes(packed[vbi(packed, 0)[1] :])


class Requests:
    def __init__(self, cfg: MqttConfig, service: Service, loop: asyncio.AbstractEventLoop, base: str) -> None:
        self.cfg = cfg
        self.service = service
        self.loop = loop
        self.prefix, self.device = base.rsplit("/", 1)
        self.v5 = cfg.protocol == "5"
        self.max_body = max_body_bytes(service.registry.cfg)
        self.offload = Offload(loop, OFFLOAD_WORKERS)
        self._log = RateLimitedLog(log)  # what a client's messages make edged say, bounded
        self.tasks: set[asyncio.Task[None]] = set()
        self.active = 0  # requests started and not ended: at most max_inflight
        # Messages beyond max_inflight that the broker sent anyway (mosquitto may exceed the
        # Receive Maximum after it restarts, and MQTT 3.1.1 has none): they wait their turn.
        self._waiting: collections.deque[tuple[Link, Delivery, codec.Incoming, str]] = collections.deque()
        self.closing = False  # from then on requests are answered 'shutting_down'

    # --- arrival (paho's callback, on the loop) ---------------------------------------------------

    def on_message(self, link: Link, msg: mqtt.MQTTMessage) -> None:
        raw_props = property_block(msg)
        payload = msg.payload if isinstance(msg.payload, bytes) else bytes(msg.payload)
        try:
            topic = msg.topic
        except UnicodeDecodeError:  # paho hands such a topic over but raises on reading it
            topic = ""
        d = link.deliveries.receive(topic, msg.mid, msg.qos, msg.dup, len(payload), len(raw_props))
        try:
            self._dispatch(link, d, msg, topic, payload, raw_props)
        except Exception:
            # A bug here must not hold back the acknowledgements of every later message.
            log.exception("MQTT: cannot handle message %d on %s", msg.mid, topic)
            self.drop(codec.model_from_topic(topic, self.prefix, self.device) or "", "internal", {})
            link.deliveries.finish(d)

    def _dispatch(
        self, link: Link, d: Delivery, msg: mqtt.MQTTMessage, topic: str, payload: bytes, raw_props: bytes
    ) -> None:
        model = codec.model_from_topic(topic, self.prefix, self.device) or mqtt_generate.model_from_topic(
            topic, self.prefix, self.device
        )
        if d.verdict is Verdict.RUNNING:
            log.info("%s: message %d redelivered while it runs; acknowledged when it ends", model, msg.mid)
            return
        reason = self._refusal(d, msg, model, len(payload))
        if reason:
            if reason != "cleared":
                self.drop(model or "", reason, {"model": model or "", "request_id": ""})
            link.deliveries.finish(d)
            return
        assert model is not None
        job = (link, d, codec.Incoming(topic, payload, msg.qos, props_raw=raw_props), model)
        if self.active >= self.cfg.max_inflight:
            self._waiting.append(job)  # acknowledged in order anyway: nothing is lost by waiting
            return
        self._start(*job)

    def _start(self, link: Link, d: Delivery, inc: codec.Incoming, model: str) -> None:
        link.deliveries.started(d)
        self.active += 1
        task = self.loop.create_task(self._handle(link, d, inc, model))
        self.tasks.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self.active -= 1
        if self._waiting:
            self._start(*self._waiting.popleft())

    def _refusal(self, d: Delivery, msg: mqtt.MQTTMessage, model: str | None, size: int) -> str:
        """Why a message is not run ('' when it is), decided without reading it."""
        if d.verdict is Verdict.REDELIVERED:
            log.warning(
                "%s: message %d was running when edged last ended (killed, crashed or stopped before it "
                "finished); dropped instead of run again",
                msg.topic,
                msg.mid,
                extra={"model": model or "", "request_id": ""},
            )
        if d.verdict is not Verdict.NEW:
            return d.verdict.value  # 'duplicate' or 'redelivered' (acks.py)
        if model is None:
            return "bad_topic"
        if msg.retain:
            # Replayed by the broker at every (re)subscription, or forwarded live with its flag
            # (MQTT 5 'retain as published'): never a request of the moment.
            if not size:
                return "cleared"
            ids = {"model": model, "request_id": ""}
            self._log.note(logging.WARNING, "retained", "retained request on %s ignored", msg.topic, extra=ids)
            return "retained"
        if not size:
            return "cleared"  # how a client clears a retained message by mistake; nothing to answer
        if self.active >= self.cfg.max_inflight and (
            msg.qos == 0 or len(self._waiting) >= self.cfg.max_inflight * WAITING_FACTOR
        ):
            return "overloaded"
        return ""

    # --- the request's task --------------------------------------------------------------------

    async def _handle(self, link: Link, d: Delivery, inc: codec.Incoming, model: str) -> None:
        try:
            await self._serve(link, inc, model)
        except asyncio.CancelledError:
            # Abandoned by a stop: left unacknowledged, so the broker redelivers it and the next
            # start drops it as 'redelivered' instead of running it again.
            raise
        except Exception:  # a bug: logged once; the message is still acknowledged below
            log.exception("%s: request failed", model, extra={"model": model, "request_id": ""})
        link.deliveries.finish(d)

    async def _serve(self, link: Link, inc: codec.Incoming, model: str) -> None:
        if inc.topic.endswith(mqtt_generate.SUFFIX) and not self.closing:  # a language model's stream
            await mqtt_generate.handle(self, link, inc, model)
            return
        extra = {"model": model, "request_id": ""}
        refuse: EdgedError | None = None
        if model not in self.service.registry.models:  # a 404 whatever the body holds, as on the socket
            refuse = ModelNotFoundError.named(model)
        elif self.closing:
            refuse = ShuttingDownError("edged is shutting down")
        received = time.perf_counter_ns()  # the statistics' compute_input starts here (edged/serving/stats.py)
        # A small property block is read here, so that where to answer is known even when reading
        # a large payload outlives the request's deadline (it was a race before).
        bad = codec.read_properties(inc) if len(inc.props_raw) <= PROPS_ON_LOOP else None
        try:
            read = bad or await self._run(inc.size, lambda: codec.read_request(inc, self.max_body, refuse))
        except DeadlineExceededError as e:  # where to answer is known if the properties were read
            read = codec.Unreadable(e, inc.response_topic, inc.user.get("id", ""))
        extra["request_id"] = codec.request_id(inc)
        if not isinstance(read, codec.Unreadable) and read.body is not None:
            read = await self._decode_json(inc, model, read)
        if isinstance(read, codec.Unreadable):
            self._unreadable(link, inc, model, read, extra)
            return
        if read.request.id:
            extra["request_id"] = read.request.id
        if inc.expired():
            self.drop(model, "expired", extra)
            return
        if not read.reply_to:
            log.warning("%s: request without a Response Topic or 'reply_to' dropped", model, extra=extra)
            self.drop(model, "no_reply_to", extra)
            return
        reply = await self._answer(model, read, extra, received)
        if inc.expired():  # the requester gave up while it ran: an answer would be noise
            self.drop(model, "expired", extra)
            return
        self._publish_reply(link, inc, read.reply_to, reply, extra)

    async def _decode_json(
        self, inc: codec.Incoming, model: str, read: codec.Decoded
    ) -> codec.Decoded | codec.Unreadable:
        """The socket's decoder (``Service.decode_infer``: the model's limits, the requested
        outputs, large bodies off the loop), so a fault gets the same code on both transports.
        Bounded by the request's timeout, counted from the message's arrival, as its reading is."""
        assert read.body is not None
        timeout = self.service.registry.cfg.server.request_timeout_ms / 1000
        left = max(0.0, inc.received + timeout - time.monotonic())
        decoding = self.service.decode_infer(model, read.body, read.header_length)
        try:
            # A small body decodes at once on the loop: no task and timer for it (as in _run).
            small = len(read.body) <= OFFLOAD_BYTES
            read.request = await decoding if small else await asyncio.wait_for(decoding, left)
        except asyncio.TimeoutError:  # the decoding thread finishes on its own
            e = DeadlineExceededError(f"reading the message took over {timeout:g} s")
            return codec.Unreadable(e, read.reply_to, inc.user.get("id", ""))
        except Exception as e:  # every failure answers (a bug too, as 'internal')
            if not isinstance(e, EdgedError):
                log.exception("%s: decoding failed", model, extra={"model": model, "request_id": ""})
            # Where its error goes is known already (decode_json read any 'reply_to' and 'id'):
            # the payload is not read again, on the loop or off it.
            return codec.Unreadable(codec.wire_error(e), read.reply_to, inc.user.get("id", "") or read.json_id)
        read.body = None
        return read

    async def _run(self, size: int, fn: Any) -> Any:
        if size <= OFFLOAD_BYTES:
            return fn()
        # Bounded like the request itself: a decode that outlives it answers deadline_exceeded
        # (the worker thread finishes on its own) instead of holding the acknowledgements back.
        timeout = self.service.registry.cfg.server.request_timeout_ms / 1000
        try:
            return await asyncio.wait_for(self.offload.run(fn), timeout)
        except asyncio.TimeoutError:
            raise DeadlineExceededError(f"reading the message took over {timeout:g} s") from None

    async def _answer(self, model: str, dec: codec.Decoded, extra: dict[str, str], received: int = 0) -> codec.Reply:
        try:
            inputs = dec.request.inputs
            if dec.raw:
                assert dec.raw_tensor is not None
                try:
                    inputs = {dec.input_name or await self._single_input(model): dec.raw_tensor}
                except EdgedError as e:  # never reached the model: counted here (service.infer counts the rest)
                    self.service.metrics.reject(model, "mqtt", e.code, known=model in self.service.registry.models)
                    raise
            results = await self.service.infer(
                model, inputs, extra["request_id"], transport="mqtt", received_ns=received
            )
            ran = time.perf_counter_ns()
            size = sum(tensors.wire_nbytes(a) for a in results.values() if isinstance(a, np.ndarray))
            try:
                served, version = self.service.versions().served(model)
                reply: codec.Reply = await self._run(size, lambda: codec.ok_reply(served, dec, results, version))
            except BaseException:
                self.service.stats.encode_failed(model, received, ran)
                raise
            self.service.stats.encoded(model, ran)
            return reply
        except BusyError as e:
            self.service.metrics.dropped.labels(model, "busy").inc()
            return codec.error_reply(e, dec.request.id)
        except Exception as e:  # every failure answers, never leaves the requester waiting
            err = codec.wire_error(e)
            if not isinstance(e, EdgedError):
                log.exception("%s: request failed", model, extra=extra)
            return codec.error_reply(err, dec.request.id)

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

    # --- replies and drops ---------------------------------------------------------------------

    def _unreadable(
        self, link: Link, inc: codec.Incoming, model: str, bad: codec.Unreadable, extra: dict[str, str]
    ) -> None:
        self.service.metrics.reject(model, "mqtt", bad.error.code, known=model in self.service.registry.models)
        if not bad.reply_to:
            log.warning(
                "%s: unreadable request without a reply topic dropped: %s", model, bad.error.message, extra=extra
            )
            self.drop(model, "no_reply_to", extra)
            return
        log.debug("%s: bad request: %s", model, bad.error.message, extra=extra)
        self._publish_reply(link, inc, bad.reply_to, codec.error_reply(bad.error, bad.rid), extra)

    def _publish_reply(
        self, link: Link, inc: codec.Incoming, topic: str, reply: codec.Reply, extra: dict[str, str]
    ) -> None:
        props = None
        if self.v5:
            props = codec.PackedProperties(
                codec.pack_properties(reply.content_type, inc.correlation, [("device", self.device), *reply.user])
            )
        try:
            link.publish(topic, reply.payload, qos=inc.qos, properties=props)
        except ValueError as e:  # a response topic with wildcards, or empty
            log.warning("cannot reply on %r: %s", topic, e, extra=extra)
            self.drop(extra["model"], "bad_reply_topic", extra)

    def drop(self, model: str, reason: str, extra: dict[str, str]) -> None:
        # Label only configured models: a typo in a topic must not grow the metrics forever.
        label = model if model in self.service.registry.models else "_unknown"
        self.service.metrics.dropped.labels(label, reason).inc()
        self._log.note(logging.INFO, reason, "%s: request dropped (%s)", model or "-", reason, extra=extra)

    # --- stop ----------------------------------------------------------------------------------

    async def drain(self, timeout: float) -> None:
        """Answer what runs (new arrivals get 'shutting_down'); abandon what outlives ``timeout``."""
        self.closing = True
        deadline = self.loop.time() + timeout
        while True:  # arrivals meanwhile are answered at once and waited for too
            pending = {t for t in self.tasks if not t.done()}
            remaining = deadline - self.loop.time()
            if not pending or remaining <= 0:
                break
            await asyncio.wait(pending, timeout=remaining)
        left = [t for t in self.tasks if not t.done()]
        for t in left:
            t.cancel()
        if left:
            log.warning("MQTT: %d request(s) still running at stop left unacknowledged", len(left))
            await asyncio.wait(left, timeout=1.0)
        self.offload.close()
