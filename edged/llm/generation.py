"""Text generation requests: sampling parameters, the job a slot runs, and the stream of tokens
handed back to the event loop.

A language model is a model like any other: its instances are its slots (each a context with its
own KV cache), and a generation is one request through the model's queue, so readiness, lazy
loading, reload holds, busy (queue full, at once), deadlines and metrics are the scheduler's and
the service's, shared with tensor models. What differs is carried by the ``GenerationJob``: the
slot's worker thread runs the whole generation and hands each piece of text to the loop with
``call_soon_threadsafe``; the loop side can cancel it (a client that went away, an MQTT request
that expired) and the slot notices before its next token. Nothing here imports an engine.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from edged.config import LlmConfig, ModelConfig
from edged.errors import BadRequestError, EdgedError, InvalidInputError
from edged.llm.schema import refuse_costly_schema
from edged.thread_to_loop import to_loop

if TYPE_CHECKING:
    from edged.serving.service import Service

# Bounds on what one request may carry, whatever the body limit: every cost stays linear and small.
# A generate request's body: a prompt and a few parameters (the context bounds the prompt anyway),
# parsed on the event loop, so far below server.max_body (both transports).
MAX_BODY = 4 << 20
MAX_STOP = 4
MAX_STOP_CHARS = 64
MAX_MESSAGES = 256
# A token is rarely more than a dozen characters; a prompt longer than this many characters per
# token of context cannot fit and is refused before it is tokenised.
CHARS_PER_TOKEN_BOUND = 16

INPUT = "text_input"
OUTPUT = "text_output"


def is_language_model(model: ModelConfig) -> bool:
    return model.backend == "llama" or (model.backend == "auto" and model.path.lower().endswith(".gguf"))


def llm_config(model: ModelConfig) -> LlmConfig:
    return model.llm if model.llm is not None else LlmConfig()


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float
    top_p: float
    stop: tuple[str, ...] = ()
    seed: int | None = None
    # A default max_tokens shrinks to what the context leaves; one the client asked for is an error.
    max_tokens_explicit: bool = False
    # Structured output: ``("json_object", "")`` or ``("json_schema", schema as JSON)``; the
    # backend turns it into a grammar that constrains every sampled token.
    response_format: tuple[str, str] | None = None
    # Log probabilities: -1 for none, else the chosen token's and this many alternatives' (0-20).
    logprobs: int = -1
    # OpenAI's penalties on tokens already generated (-2 to 2; 0 is none): presence subtracts
    # once from a token that has appeared, frequency once per appearance.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # OpenAI's logit_bias: (token id, bias added to its logit, -100 to 100), sorted by id.
    logit_bias: tuple[tuple[int, float], ...] = ()


@dataclass(eq=False)
class GenerationJob:
    """One generation, filled in by the slot that runs it (on its worker thread)."""

    prompt: str = ""
    messages: list[dict[str, str]] | None = None  # chat: rendered with the model's own template
    sampling: Sampling = field(default_factory=lambda: Sampling(16, 0.0, 1.0))
    context: int = 2048
    deadline: float = float("inf")  # time.monotonic()
    cancelled: threading.Event = field(default_factory=threading.Event)
    emit: Callable[[str], None] | None = None  # called on the worker thread for each piece of text
    warmup: bool = False
    # Results.
    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = ""
    first_token_s: float | None = None
    error: EdgedError | None = None
    # Per generated token when ``sampling.logprobs`` >= 0: OpenAI's ``{token, logprob, bytes,
    # top_logprobs}``.
    token_logprobs: list[dict[str, Any]] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens reused from a kept prefix instead of prefilled

    def tensor(self) -> np.ndarray:
        """The job as the model's one input: a request travels through the model's queue."""
        arr = np.empty((1,), dtype=object)
        arr[0] = self
        return arr


class StopMatcher:
    """Stop strings over streamed text: text that could still turn into a stop string is held
    back, so a client never sees part of one. Cost per piece is bounded by the longest stop."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        self._held = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string was reached)."""
        if not self.stops:
            return piece, False
        text = self._held + piece
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            return text[:cut], True
        keep = 0
        for n in range(min(self.longest - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                keep = n
                break
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


# --- request parameters ---------------------------------------------------------------------------


def _number(body: Mapping[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise InvalidInputError(f"'{key}' must be a number in [{lo}, {hi}], got {value!r}")
    return float(value)


def _stops(value: Any, defaults: Sequence[str]) -> tuple[str, ...]:
    if value is None:
        return tuple(defaults)
    stops = [value] if isinstance(value, str) else value
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOP
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)
    ):
        raise InvalidInputError(f"'stop' must be a string or up to {MAX_STOP} strings of 1-{MAX_STOP_CHARS} characters")
    return tuple(stops)


def sampling_from(body: Mapping[str, Any], llm: LlmConfig) -> Sampling:
    """Sampling parameters from a request (OpenAI's names; Triton's ``parameters`` use the same),
    defaults from the model's ``[models.NAME.llm]``."""
    raw_max = body.get("max_completion_tokens", body.get("max_tokens"))
    if raw_max is not None and (isinstance(raw_max, bool) or not isinstance(raw_max, int) or raw_max < 1):
        raise InvalidInputError(f"'max_tokens' must be a positive integer, got {raw_max!r}")
    if raw_max is not None and raw_max > llm.max_tokens_limit:
        raise InvalidInputError(f"'max_tokens' {raw_max} exceeds this model's limit of {llm.max_tokens_limit}")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32):
        raise InvalidInputError(f"'seed' must be an integer in [0, 2**32), got {seed!r}")
    n = body.get("n", 1)
    if n != 1:
        raise InvalidInputError("only n = 1 is served")
    return Sampling(
        max_tokens=raw_max if raw_max is not None else llm.max_tokens,
        temperature=_number(body, "temperature", llm.temperature, 0.0, 2.0),
        top_p=_number(body, "top_p", llm.top_p, 0.0, 1.0),
        stop=_stops(body.get("stop"), llm.stop),
        seed=seed,
        max_tokens_explicit=raw_max is not None,
        response_format=response_format_from(body.get("response_format")),
        logprobs=logprobs_from(body),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        logit_bias=logit_bias_from(body.get("logit_bias")),
    )


MAX_LOGIT_BIAS = 1024  # entries: each is applied to every draw, so their number bounds its cost


def logit_bias_from(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: token ids (as JSON object keys, so strings) to a bias in
    [-100, 100]. Whether an id exists is the backend's to say: only it knows the vocabulary."""
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise InvalidInputError(f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} token ids to biases")
    out: dict[int, float] = {}
    for key, bias in value.items():
        text = str(key)
        if not (text.isascii() and text.isdigit() and len(text) <= 9):
            raise InvalidInputError(f"'logit_bias' keys must be token ids (non-negative integers), got {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise InvalidInputError(f"'logit_bias' of token {text} must be a number in [-100, 100], got {bias!r}")
        out[int(text)] = float(bias)
    return tuple(sorted(out.items()))


MAX_SCHEMA_BYTES = 32 << 10  # a JSON schema becomes a grammar: its size bounds the grammar's
MAX_TOP_LOGPROBS = 20


def response_format_from(value: Any) -> tuple[str, str] | None:
    """OpenAI's ``response_format``: text (nothing to do), ``json_object`` or ``json_schema``."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ("json_object", "")
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidInputError("'response_format.json_schema.schema' must be a JSON schema object")
        refuse_costly_schema(schema)
        text = json.dumps(schema, separators=(",", ":"))
        if len(text) > MAX_SCHEMA_BYTES:
            raise InvalidInputError(f"'response_format' schema is over {MAX_SCHEMA_BYTES} bytes")
        return ("json_schema", text)
    raise InvalidInputError("'response_format.type' must be text, json_object or json_schema")


def logprobs_from(body: Mapping[str, Any]) -> int:
    """-1 for none, else how many alternatives each token reports. Chat sends ``logprobs: true``
    with ``top_logprobs: N``; completions send ``logprobs: N``."""
    value, top = body.get("logprobs"), body.get("top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise InvalidInputError(f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}]")
    if value is None or value is False:
        if top is not None:
            raise InvalidInputError("'top_logprobs' needs 'logprobs': true")
        return -1
    if value is True:
        return top or 0
    if isinstance(value, int) and 0 <= value <= MAX_TOP_LOGPROBS:
        return value
    raise InvalidInputError(f"'logprobs' must be true, false or an integer in [0, {MAX_TOP_LOGPROBS}]")


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI's content parts: text only
        parts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidInputError(f"{where}: only text content parts are served")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidInputError(f"{where}: 'content' must be a string or a list of text parts")


def messages_from(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise InvalidInputError("'messages' must be a non-empty list")
    if len(value) > MAX_MESSAGES:
        raise InvalidInputError(f"'messages' holds more than {MAX_MESSAGES} messages")
    out = []
    for i, msg in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise InvalidInputError(f"{where} must be an object")
        role = msg.get("role")
        if role == "developer":  # OpenAI's newer name for the system role
            role = "system"
        if role not in ("system", "user", "assistant"):
            raise InvalidInputError(f"{where}.role must be system, user or assistant, got {role!r}")
        out.append({"role": role, "content": _content(msg.get("content"), where)})
    return out


def make_job(
    model: ModelConfig,
    body: Mapping[str, Any],
    timeout_s: float,
    *,
    prompt: str | None = None,
    messages: list[dict[str, str]] | None = None,
) -> GenerationJob:
    """A job for ``model``: parameters checked, prompt size bounded before any tokenising."""
    llm = llm_config(model)
    if prompt is None and messages is None:
        raise BadRequestError("a generation needs a prompt or messages")
    chars = len(prompt or "") + sum(len(m["content"]) for m in messages or ())
    if chars > llm.context * CHARS_PER_TOKEN_BOUND:
        raise InvalidInputError(f"the prompt ({chars} characters) cannot fit in the context of {llm.context} tokens")
    return GenerationJob(
        prompt=prompt or "",
        messages=messages,
        sampling=sampling_from(body, llm),
        context=llm.context,
        deadline=time.monotonic() + timeout_s,
    )


def request_timeout(service: Service, name: str) -> float:
    """The deadline the service gives a request of this model (the same the queue enforces)."""
    rt = service.model(name)
    return (rt.cfg.timeout_ms or service.registry.cfg.server.request_timeout_ms) / 1000


# --- running on the loop ----------------------------------------------------------------------------


def _consume(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: an abandoned stream's error is already reported


async def complete(
    service: Service, name: str, job: GenerationJob, request_id: str = "", transport: str = "http"
) -> str:
    """Run ``job`` to the end; returns the text (the job holds counts and the finish reason).
    A caller that is cancelled (its client went away) cancels the generation."""
    try:
        await service.infer(name, {INPUT: job.tensor()}, request_id, transport)
    finally:
        job.cancelled.set()  # a no-op once finished; frees the slot when the caller left early
    if job.error is not None:
        raise job.error
    return job.text


async def stream(
    service: Service, name: str, job: GenerationJob, request_id: str = "", transport: str = "http"
) -> AsyncIterator[str]:
    """Yield the text of ``job`` piece by piece (one piece per token, except where a stop string
    or a multi-byte character holds text back). Leaving the iteration early cancels the job."""
    loop = asyncio.get_running_loop()
    pieces: asyncio.Queue[str | None] = asyncio.Queue()
    put = pieces.put_nowait

    def emit(piece: str) -> None:  # on the slot's thread
        to_loop(loop, put, piece)

    job.emit = emit
    task = loop.create_task(service.infer(name, {INPUT: job.tensor()}, request_id, transport))
    # Pieces were queued (call_soon_threadsafe, in order) before the result that ends the task.
    task.add_done_callback(lambda _t: put(None))
    try:
        while (piece := await pieces.get()) is not None:
            yield piece
        task.result()
        if job.error is not None:
            raise job.error
    finally:
        job.cancelled.set()
        if not task.done():
            task.cancel()  # frees its place in the queue now; the slot stops before its next token
        task.add_done_callback(_consume)
