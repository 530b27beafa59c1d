"""Generation over MQTT: a request on ``{prefix}/{device}/models/{model}/generate`` streams its
text to the response topic, one message per token.

Request (JSON): ``{"prompt": "..."}`` or ``{"messages": [...]}`` (the model's chat template), with
the OpenAI sampling names (``max_tokens``, ``temperature``, ``top_p``, ``stop``, ``seed``,
``response_format``; not ``logprobs``, which HTTP serves); MQTT 3.1.1 clients add ``reply_to`` and
``id``. Each reply carries the request's Correlation Data and
is numbered: ``{"seq": 0, "text": "Hello", "final": false}`` ... and the last one
``{"seq": n, "text": "", "final": true, "finish_reason": ..., "usage": {...}}`` (user properties
``seq`` and ``final`` say the same for clients that do not parse the body). An error is one final
message with ``error`` and ``code``. A request whose Message Expiry passes is cancelled: its slot
stops before the next token and nothing more is published.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from edged.errors import BadRequestError, BusyError, EdgedError
from edged.llm import generation as gen
from edged.transports.mqtt import codec
from edged.wire.jsondoc import load_object

if TYPE_CHECKING:
    from edged.serving.service import Service
    from edged.transports.mqtt.link import Link


class Requests(Protocol):
    """What a generation needs of the MQTT request handler (requests.Requests)."""

    service: Service
    v5: bool
    device: str

    def drop(self, model: str, reason: str, extra: dict[str, str]) -> None: ...


log = logging.getLogger(__name__)

SUFFIX = "/generate"
MAX_BODY = gen.MAX_BODY
# These replies have no place for per-token log probabilities: refused by name rather than
# half served.
HTTP_ONLY = ("logprobs", "top_logprobs")


def model_from_topic(topic: str, prefix: str, device: str) -> str | None:
    """``{prefix}/{device}/models/{model}/generate`` → model."""
    parts = topic.split("/")
    head = prefix.split("/")
    n = len(head)
    if parts[:n] != head or len(parts) != n + 4 or parts[n] != device or parts[n + 1] != "models":
        return None
    return parts[n + 2] if parts[n + 3] == "generate" and parts[n + 2] else None


def _decode(payload: bytes) -> dict[str, Any]:
    return load_object(payload, "a generate request is a JSON object")


class Replies:
    """Numbered messages to one requester, each with its Correlation Data."""

    def __init__(self, requests: Requests, link: Link, inc: codec.Incoming, topic: str, rid: str) -> None:
        self.requests, self.link, self.inc, self.topic, self.rid = requests, link, inc, topic, rid
        self.seq = 0

    def send(self, doc: dict[str, Any], final: bool = False) -> None:
        r = self.requests
        body = dict(doc, seq=self.seq, final=final)
        if self.rid:
            body["id"] = self.rid
        props = None
        if r.v5:
            user = [("device", r.device), ("seq", str(self.seq)), ("final", "true" if final else "false")]
            props = codec.PackedProperties(codec.pack_properties(codec.JSON, self.inc.correlation, user))
        self.seq += 1
        try:
            self.link.publish(self.topic, orjson.dumps(body), qos=self.inc.qos, properties=props)
        except ValueError as e:  # a response topic with wildcards, or empty
            log.warning("cannot reply on %r: %s", self.topic, e)


async def handle(requests: Requests, link: Link, inc: codec.Incoming, model: str) -> None:
    """One generate request, from its properties to its final message (or a counted drop)."""
    extra = {"model": model, "request_id": ""}
    try:
        if inc.props_raw:
            inc.apply(codec.parse(inc.props_raw))
    except Exception:  # no reply path is known without the properties
        requests.drop(model, "no_reply_to", extra)
        return
    extra["request_id"] = codec.request_id(inc)
    if inc.expired():
        requests.drop(model, "expired", extra)
        return
    err: EdgedError | None = None
    doc: dict[str, Any] = {}
    try:
        if len(inc.payload) > MAX_BODY:
            raise BadRequestError(f"a generate request is limited to {MAX_BODY} bytes")
        doc = _decode(inc.payload)
    except EdgedError as e:
        err = e
    reply_to = inc.response_topic or str(doc.get("reply_to") or "")
    rid = str(doc.get("id") or inc.user.get("id", ""))
    if not reply_to:
        requests.drop(model, "no_reply_to", extra)
        return
    replies = Replies(requests, link, inc, reply_to, rid)
    if err is not None:
        replies.send(err.to_dict(), final=True)
        return
    await _generate(requests, model, doc, inc, replies, rid or uuid.uuid4().hex)


async def _generate(
    requests: Requests, model: str, doc: dict[str, Any], inc: codec.Incoming, replies: Replies, rid: str
) -> None:
    service = requests.service
    timer: asyncio.TimerHandle | None = None
    try:
        rt = service.model(model)
        if not gen.is_language_model(rt.cfg):
            raise BadRequestError(f"model '{model}' is not a language model")
        asked = [k for k in HTTP_ONLY if doc.get(k) not in (None, False)]
        if asked:
            raise BadRequestError(f"{', '.join(asked)}: served over HTTP, not over MQTT")
        timeout = gen.request_timeout(service, model)
        if "messages" in doc:
            job = gen.make_job(rt.cfg, doc, timeout, messages=gen.messages_from(doc["messages"]))
        elif isinstance(doc.get("prompt"), str):
            job = gen.make_job(rt.cfg, doc, timeout, prompt=doc["prompt"])
        else:
            raise BadRequestError("a generate request needs 'prompt' (a string) or 'messages'")
        if inc.deadline is not None:  # the requester's expiry cancels the generation (same clock)
            timer = asyncio.get_running_loop().call_at(inc.deadline, job.cancelled.set)
        async for piece in gen.stream(service, model, job, rid, transport="mqtt"):
            if not job.cancelled.is_set():
                replies.send({"text": piece})
        if inc.expired():
            requests.drop(model, "expired", {"model": model, "request_id": rid})
            return
        usage = {"prompt_tokens": job.prompt_tokens, "completion_tokens": job.completion_tokens}
        replies.send({"text": "", "finish_reason": job.finish_reason, "usage": usage}, final=True)
    except BusyError as e:
        service.metrics.dropped.labels(model, "busy").inc()
        replies.send(e.to_dict(), final=True)
    except EdgedError as e:
        if not inc.expired():
            replies.send(e.to_dict(), final=True)
    except Exception as e:  # a bug must answer, never leave the requester waiting
        log.exception("%s: generation failed", model, extra={"model": model, "request_id": rid})
        replies.send(EdgedError(f"internal error: {e}").to_dict(), final=True)
    finally:
        if timer is not None:
            timer.cancel()
