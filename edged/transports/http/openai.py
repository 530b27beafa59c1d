"""Generation over HTTP: Triton's generate extension and the OpenAI-compatible API.

- ``POST /v2/models/{m}/generate`` (``text_input`` and sampling parameters, top level or under
  ``parameters``) → ``text_output``; ``/v2/models/{m}/generate_stream``: Server-Sent Events, one
  event per token, as Triton sends them.
- ``POST /v1/chat/completions`` (the model's own chat template), ``POST /v1/completions``,
  ``stream: true`` as SSE ending with ``data: [DONE]``; ``GET /v1/models``. The official
  ``openai`` client works unchanged; errors use OpenAI's ``{"error": {...}}`` shape there.
  ``response_format`` (JSON, or JSON following a schema) constrains every sampled token;
  ``logprobs`` come back per token, in the chat form or the completions' legacy form.

A client that disconnects cancels its generation (the slot stops before its next token and the
request leaves the queue). Generation runs on the model's slot threads, never on the loop.
"""

from __future__ import annotations

import asyncio
import codecs
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson

from edged.errors import (
    BadRequestError,
    EdgedError,
    NotFoundError,
    PayloadTooLargeError,
    ShuttingDownError,
)
from edged.llm import generation as gen
from edged.serving.service import Service
from edged.transports.budget import BodyBudget
from edged.transports.http.body import read_body
from edged.transports.http.methods import error_headers
from edged.transports.http.methods import expect as _expect
from edged.transports.http.streaming import error_body_for, respond, sse, stream, until_disconnect
from edged.wire.jsondoc import load_object

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

_JSON: Headers = [(b"content-type", b"application/json")]
# A generation request is a prompt and a few parameters; the context bounds the prompt anyway.
MAX_BODY = 4 << 20


def handles(path: str) -> bool:
    """Whether a path belongs to the generation routes (checked before the v2 tensor routes)."""
    if path.startswith("/v1/"):
        return True
    return path.startswith("/v2/models/") and (path.endswith("/generate") or path.endswith("/generate_stream"))


class GenerationRoutes:
    def __init__(self, service: Service, max_body: int, bodies: BodyBudget | None = None) -> None:
        self.service = service
        self.max_body = min(max_body, MAX_BODY)
        self.bodies = bodies
        self.accepting = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        openai = scope["path"].startswith("/v1/")
        try:
            await self._dispatch(scope, receive, send)
        except EdgedError as e:
            await respond(send, e.http_status, error_body_for(e, openai), error_headers(e, _JSON))
        except Exception as e:  # a bug answers 500, never drops the connection silently
            log.exception("unhandled error on %s", scope.get("path"))
            await respond(send, 500, error_body_for(EdgedError(f"internal error: {e}"), openai))

    async def warm(self, name: str) -> None:
        """Before READY=1: requests through these routes (chat and completions, streamed and
        not, a grammar and log probabilities, and Triton's stream), so the first client's
        request runs warm code end to end."""
        short = {"max_tokens": 2, "temperature": 0.0}
        chat = dict(short, model=name, messages=[{"role": "user", "content": "Hello"}])
        shaped = dict(chat, response_format={"type": "json_object"}, logprobs=True, top_logprobs=2)
        calls = [
            ("/v1/chat/completions", chat),
            ("/v1/chat/completions", dict(chat, stream=True)),
            ("/v1/chat/completions", shaped),
            ("/v1/completions", dict(short, model=name, prompt="Hello", stream=True)),
            (f"/v2/models/{name}/generate_stream", dict(short, text_input="Hello")),
        ]
        for path, doc in calls:
            status = await _call(self, path, orjson.dumps(doc))
            if status != 200:
                log.warning("%s: warm-up request on %s answered %d", name, path, status, extra={"model": name})

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        method, parts = scope["method"], scope["path"].strip("/").split("/")
        if parts == ["v1", "models"]:
            _expect(method, "GET")
            await respond(send, 200, orjson.dumps(self._models()))
            return
        if len(parts) == 3 and parts[:2] == ["v1", "models"]:
            _expect(method, "GET")
            await respond(send, 200, orjson.dumps(self._model_card(parts[2])))
            return
        routes = {("v1", "chat", "completions"): self._chat, ("v1", "completions"): self._completions}
        handler = routes.get(tuple(parts))
        if handler is None and len(parts) == 4 and parts[:2] == ["v2", "models"]:
            handler = self._triton
        if handler is None:
            raise NotFoundError(f"no route for {scope['path']}")
        _expect(method, "POST")
        if not self.accepting or self.service.stopping:
            raise ShuttingDownError("edged is shutting down")
        body = await self._body(scope, receive)
        await handler(parts, body, receive, send)

    async def _body(self, scope: Scope, receive: Receive) -> dict[str, Any]:
        limit = min(self.max_body, gen.MAX_BODY)  # parsed on the loop: a prompt, not a tensor
        try:  # gzip and deflate bodies too, bounded as sent and as inflated
            raw = await read_body(scope, receive, limit, budget=self.bodies)
        except PayloadTooLargeError:
            raise PayloadTooLargeError(f"a generation request is limited to {limit} bytes") from None
        return load_object(raw, "the body must be a JSON object")

    # --- models ---

    def _language_models(self) -> list[str]:
        return [n for n, rt in self.service.registry.models.items() if gen.is_language_model(rt.cfg)]

    def _model_card(self, name: str) -> dict[str, Any]:
        if name not in self._language_models():
            raise NotFoundError(f"no language model '{name}'")
        return {"id": name, "object": "model", "created": int(self.service.started), "owned_by": "edged"}

    def _models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._model_card(n) for n in self._language_models()]}

    def _model(self, name: Any) -> str:
        if not isinstance(name, str) or not name:
            raise BadRequestError("'model' must name a language model")
        rt = self.service.model(name)
        if not gen.is_language_model(rt.cfg):
            raise BadRequestError(f"model '{name}' is not a language model")
        return name

    # --- OpenAI ---

    async def _chat(self, parts: list[str], body: dict[str, Any], receive: Receive, send: Send) -> None:
        name = self._model(body.get("model"))
        refuse_unsupported(body)
        job = self._job(name, body, messages=gen.messages_from(body.get("messages")))
        await self._openai(name, job, body, receive, send, chat=True)

    async def _completions(self, parts: list[str], body: dict[str, Any], receive: Receive, send: Send) -> None:
        name = self._model(body.get("model"))
        refuse_unsupported(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise BadRequestError("'prompt' must be a string")
        job = self._job(name, body, prompt=prompt)
        await self._openai(name, job, body, receive, send, chat=False, offset=len(prompt))

    def _job(self, name: str, body: dict[str, Any], **kw: Any) -> gen.GenerationJob:
        return gen.make_job(self.service.model(name).cfg, body, gen.request_timeout(self.service, name), **kw)

    async def _openai(
        self,
        name: str,
        job: gen.GenerationJob,
        body: dict[str, Any],
        receive: Receive,
        send: Send,
        chat: bool,
        offset: int = 0,
    ) -> None:
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        head = {"id": rid, "created": int(time.time()), "model": name}
        logprobs = LogprobsOut(job, chat, offset)
        if not _flag(body, "stream"):
            text = await until_disconnect(gen.complete(self.service, name, job, rid), receive)
            if text is None:
                return
            choice: dict[str, Any] = {"index": 0, "finish_reason": job.finish_reason, "logprobs": logprobs.take(True)}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            doc = dict(
                head, object="chat.completion" if chat else "text_completion", choices=[choice], usage=_usage(job)
            )
            await respond(send, 200, orjson.dumps(doc))
            return
        kind = "chat.completion.chunk" if chat else "text_completion"
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise BadRequestError("'stream_options' must be an object")
        usage = options is not None and _flag(options, "include_usage")

        def chunk(delta: str | None, finish: str | None) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": logprobs.take()}
            if chat:
                choice["delta"] = {} if delta is None else {"content": delta}
            else:
                choice["text"] = delta or ""
            return dict(head, object=kind, choices=[choice])

        async def events() -> AsyncIterator[bytes]:
            if chat:
                first = {
                    "index": 0,
                    "finish_reason": None,
                    "logprobs": None,
                    "delta": {"role": "assistant", "content": ""},
                }
                yield sse(dict(head, object=kind, choices=[first]))
            async for piece in gen.stream(self.service, name, job, rid):
                yield sse(chunk(piece, None))
            yield sse(chunk(None, job.finish_reason))
            if usage:
                yield sse(dict(head, object=kind, choices=[], usage=_usage(job)))
            yield b"data: [DONE]\n\n"

        await stream(send, receive, events(), openai=True)

    # --- Triton's generate extension ---

    async def _triton(self, parts: list[str], body: dict[str, Any], receive: Receive, send: Send) -> None:
        name, route = parts[2], parts[3]
        if route not in ("generate", "generate_stream"):
            raise NotFoundError(f"no route for /{'/'.join(parts)}")
        self._model(name)
        params = body.get("parameters", {})
        if not isinstance(params, dict):
            raise BadRequestError("'parameters' must be an object")
        text = body.get("text_input")
        if not isinstance(text, str):
            raise BadRequestError("'text_input' must be a string")
        merged = {**{k: v for k, v in body.items() if k not in ("text_input", "parameters")}, **params}
        job = self._job(name, merged, prompt=text)
        if job.sampling.logprobs >= 0:  # Triton's answer has no place for them: never computed unread
            raise BadRequestError("'logprobs' are served on /v1/chat/completions and /v1/completions")
        rid = str(body.get("id", "")) or uuid.uuid4().hex
        head = {"model_name": name, "model_version": "1", "id": rid}
        if route == "generate":
            out = await until_disconnect(gen.complete(self.service, name, job, rid), receive)
            if out is not None:
                await respond(send, 200, orjson.dumps(dict(head, text_output=out, **_triton_tail(job))))
            return

        async def events() -> AsyncIterator[bytes]:
            async for piece in gen.stream(self.service, name, job, rid):
                yield sse(dict(head, text_output=piece))
            yield sse(dict(head, text_output="", **_triton_tail(job)))

        await stream(send, receive, events(), openai=False)


async def _call(app: GenerationRoutes, path: str, body: bytes) -> int:
    """One request through the routes without a socket; returns the status."""
    scope: Scope = {"type": "http", "method": "POST", "path": path, "headers": []}
    sent = False
    status = 0

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:  # the client stays: the disconnect watcher waits until it is cancelled
            await asyncio.get_running_loop().create_future()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(scope, receive, send)
    return status


def _triton_tail(job: gen.GenerationJob) -> dict[str, Any]:
    return {"finish_reason": job.finish_reason, "prompt_tokens": job.prompt_tokens, "tokens": job.completion_tokens}


def _usage(job: gen.GenerationJob) -> dict[str, Any]:
    return {
        "prompt_tokens": job.prompt_tokens,
        "completion_tokens": job.completion_tokens,
        "total_tokens": job.prompt_tokens + job.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": job.cached_tokens},
    }


class LogprobsOut:
    """A job's per-token log probabilities handed out in order, each once: all of them for a
    whole answer, those produced since the last chunk for a stream. Chat's form is OpenAI's
    ``{"content": [...]}``; completions' the legacy ``{"tokens", "token_logprobs",
    "top_logprobs", "text_offset"}``, offsets counted from the start of the prompt as OpenAI's."""

    def __init__(self, job: gen.GenerationJob, chat: bool, offset: int = 0) -> None:
        self.job, self.chat = job, chat
        self.sent = 0
        self.offset = offset
        # Offsets count the characters of the text, and a character may span two tokens.
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def take(self, always: bool = False) -> dict[str, Any] | None:
        """The entries not handed out yet, in this answer's form; None when none were asked
        for, or (unless ``always``: a whole answer lists its entries, none or some) none are new."""
        job = self.job
        if job.sampling.logprobs < 0:
            return None
        # The decoding thread appends a token's entry just before it counts the token: the count
        # bounds what is handed out, so every entry handed out is one of ``completion_tokens``.
        end = min(len(job.token_logprobs), job.completion_tokens)
        if end <= self.sent and not always:
            return None
        entries, self.sent = job.token_logprobs[self.sent : end], max(self.sent, end)
        return {"content": entries, "refusal": None} if self.chat else self._legacy(entries)

    def _legacy(self, entries: list[dict[str, Any]]) -> dict[str, Any]:
        offsets, tops = [], []
        for entry in entries:
            offsets.append(self.offset)
            self.offset += len(self.decoder.decode(bytes(entry["bytes"])))
            top: dict[str, float] = {}
            for alt in entry["top_logprobs"]:  # most likely first: the first of equal strings stays
                top.setdefault(alt["token"], alt["logprob"])
            top.setdefault(entry["token"], entry["logprob"])  # the chosen token is always listed
            tops.append(top)
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": tops,
            "text_offset": offsets,
        }


def _flag(body: dict[str, Any], key: str) -> bool:
    """A boolean field: true, false or absent; anything else ("yes", 1) is a 400, not a guess."""
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequestError(f"'{key}' must be true or false")
    return value


# OpenAI request fields edged does not implement, with the value that asks for nothing.
_NOTHING_ASKED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
}


def unsupported(body: dict[str, Any]) -> list[str]:
    """The fields of an OpenAI request that ask for what edged does not do (tool calls, several
    choices, the prompt echoed or completed around a suffix): answered with a 400 naming them,
    never ignored, so that a client is not handed text it did not ask for."""
    return sorted(key for key, nothing in _NOTHING_ASKED.items() if key in body and body[key] not in nothing)


def refuse_unsupported(body: dict[str, Any]) -> None:
    found = unsupported(body)
    if found:
        raise BadRequestError(f"{', '.join(found)}: not supported by edged; leave them out")
