"""Structured output and log probabilities through the OpenAI routes, with the official ``openai``
client and the real SmolLM2-135M served by the real daemon (test_llm's daemon and client), and
what Triton's generate and MQTT take of them. SmolLM2-135M is tiny: these tests check the shape
of what it writes, never its content."""

from __future__ import annotations

import json
import math
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import DaemonProcess
from tests.integration.mosquitto import Broker, Peer
from tests.integration.test_llm import (
    COUNTING,
    DEV,
    WEATHER,
    edge,
    http,
    module_broker,
    openai_client,
    smollm2,
    tcp_port,
)
from tests.integration.test_llm_sampling import _token_id

pytestmark = pytest.mark.integration

__all__ = ["edge", "module_broker", "openai_client", "smollm2", "tcp_port"]  # fixtures pytest finds here

ASK = [{"role": "user", "content": "Describe a cat as JSON."}]
PERSON = {
    "type": "object",
    "properties": {
        # Bounded, so that the answer is a few dozen tokens whatever the model does.
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "pets": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}


def _schema(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


# --- response_format ---------------------------------------------------------------------------


def test_json_object_gives_text_that_parses(openai_client: Any) -> None:
    # A prompt the model answers, greedily, with a short object (asked for an empty one, SmolLM2 nests
    # objects until max_tokens on some CPUs' kernels): the grammar keeps it JSON, not short.
    ask = [{"role": "user", "content": 'Reply with exactly this JSON and nothing else: {"ok": true}'}]
    fmt = {"type": "json_object"}
    out = openai_client.chat.completions.create(
        model="llm", messages=ask, max_tokens=120, temperature=0, response_format=fmt
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice.message.content  # the grammar closed the object, then ended
    assert isinstance(json.loads(choice.message.content), dict)
    # Completions too (the client has no argument for it there), streamed: the pieces join into
    # one JSON object.
    chunks = openai_client.completions.create(
        model="llm",
        prompt="1, 2, 3, 4,",
        max_tokens=120,
        temperature=0,
        stream=True,
        extra_body={"response_format": fmt},
    )
    assert isinstance(json.loads("".join(c.choices[0].text for c in chunks)), dict)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_gives_its_required_keys_and_types(openai_client: Any, temperature: float) -> None:
    out = openai_client.chat.completions.create(
        model="llm",
        messages=[{"role": "user", "content": "Who are you? Answer as JSON."}],
        max_tokens=120,
        temperature=temperature,
        seed=11,
        response_format=_schema(PERSON),
    )
    doc = json.loads(out.choices[0].message.content)
    assert set(doc) == {"name", "age", "pets"}
    assert isinstance(doc["name"], str) and len(doc["name"]) <= 12
    assert isinstance(doc["age"], int)
    assert isinstance(doc["pets"], list) and len(doc["pets"]) <= 2 and all(isinstance(p, str) for p in doc["pets"])


def test_a_schema_string_never_holds_a_raw_control_character(openai_client: Any, smollm2: Path) -> None:
    # The newline pushed as hard as a bias can: a grammar that lets a string hold it gives text no
    # JSON parser takes, in the string and in a pattern's '.'.
    newline = _token_id(smollm2, "\n")
    schema = {
        "type": "object",
        "properties": {
            "note": {"type": "string", "maxLength": 12},
            "code": {"type": "string", "pattern": "^a..$"},
        },
        "required": ["note", "code"],
        "additionalProperties": False,
    }
    out = openai_client.chat.completions.create(
        model="llm",
        messages=[{"role": "user", "content": "Write a poem as JSON."}],
        max_tokens=60,
        temperature=0,
        logit_bias={str(newline): 100},
        response_format=_schema(schema),
    )
    text = out.choices[0].message.content
    doc = json.loads(text)
    assert set(doc) == {"note", "code"} and doc["code"].startswith("a") and len(doc["code"]) == 3, text
    assert not any(ord(ch) < 0x20 for ch in doc["note"] + doc["code"]), text


# --- logprobs ----------------------------------------------------------------------------------


def _check_entry(entry: Any, top: int, greedy: bool) -> None:
    assert entry.logprob <= 0 and bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    alternatives = entry.top_logprobs
    assert len(alternatives) == top
    values = [a.logprob for a in alternatives]
    assert all(v <= 0 for v in values) and values == sorted(values, reverse=True)
    if greedy:  # the chosen token is the most likely one
        assert alternatives[0].token == entry.token and math.isclose(alternatives[0].logprob, entry.logprob)


def _text(entries: list[Any]) -> str:
    """The text of these tokens, as the daemon decodes it (a character cut short is U+FFFD)."""
    return b"".join(bytes(e.bytes) for e in entries).decode("utf-8", errors="replace")


def test_chat_logprobs_one_entry_per_token_with_the_alternatives_asked(openai_client: Any) -> None:
    out = openai_client.chat.completions.create(
        model="llm", messages=ASK, max_tokens=16, temperature=0, logprobs=True, top_logprobs=3
    )
    entries = out.choices[0].logprobs.content
    assert len(entries) == out.usage.completion_tokens > 0
    for entry in entries:
        _check_entry(entry, 3, greedy=True)
    assert _text(entries) == out.choices[0].message.content
    # logprobs alone: the chosen token's, no alternatives.
    bare = openai_client.chat.completions.create(model="llm", messages=ASK, max_tokens=4, logprobs=True)
    assert len(bare.choices[0].logprobs.content) == bare.usage.completion_tokens
    assert all(e.top_logprobs == [] for e in bare.choices[0].logprobs.content)


def test_completions_logprobs_in_the_legacy_form(openai_client: Any) -> None:
    out = openai_client.completions.create(model="llm", prompt=COUNTING, max_tokens=8, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens == 8
    assert "".join(lp.tokens) == out.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs)
    # Offsets from the start of the prompt, as OpenAI counts them.
    assert lp.text_offset == [len(COUNTING) + len("".join(lp.tokens[:i])) for i in range(8)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and max(top, key=top.get) == token and math.isclose(top[token], value)


def test_streamed_logprobs_add_up_to_the_completion_tokens(openai_client: Any) -> None:
    chunks = list(
        openai_client.chat.completions.create(
            model="llm",
            messages=ASK,
            max_tokens=24,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = chunks[-1].usage
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == usage.completion_tokens > 1
    for entry in entries:
        _check_entry(entry, 2, greedy=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert _text(entries) == text
    # Completions: the legacy form, chunk by chunk, offsets running on from one chunk to the next.
    pieces = list(
        openai_client.completions.create(
            model="llm",
            prompt=COUNTING,
            max_tokens=10,
            temperature=0,
            logprobs=1,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    forms = [c.choices[0].logprobs for c in pieces if c.choices and c.choices[0].logprobs]
    tokens = [t for f in forms for t in f.tokens]
    offsets = [o for f in forms for o in f.text_offset]
    assert len(tokens) == pieces[-1].usage.completion_tokens == 10
    assert offsets == [len(COUNTING) + len("".join(tokens[:i])) for i in range(10)]


def test_usage_reports_the_prompt_tokens_reused_from_a_kept_prefix(openai_client: Any) -> None:
    messages = [{"role": "user", "content": f"Count the letters of {uuid.uuid4().hex}."}]
    first = openai_client.chat.completions.create(model="llm", messages=messages, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens
    again = openai_client.chat.completions.create(model="llm", messages=messages, max_tokens=2, temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens_details.cached_tokens < cached < again.usage.prompt_tokens


# --- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "said"),
    [
        (_schema("an object, please"), "must be a JSON schema object"),
        (_schema({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2000)}}), "bytes"),
        # Expanded, bounds like these are grammars deep enough to end the daemon.
        (_schema({"type": "string", "maxLength": 50000}), "maxLength is 50000"),
        (_schema({"type": "string", "pattern": "^a{0,20000}$"}), "pattern repeats 20000 times"),
        # Numeric bounds the converter would drop without a word are refused by name.
        (
            _schema({"type": "object", "properties": {"age": {"type": "integer", "maximum": 150}}}),
            "maximum is not enforced",
        ),
        (_schema({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}), "llama.cpp"),
        ({"type": "xml"}, "json_object or json_schema"),
    ],
)
def test_a_bad_schema_is_a_400_naming_what_is_wrong(openai_client: Any, fmt: dict[str, Any], said: str) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.chat.completions.create(model="llm", messages=ASK, max_tokens=4, response_format=fmt)
    e = refused.value
    assert e.status_code == 400 and e.code == "invalid_input" and e.type == "invalid_input"
    assert said in e.message, e.message
    # The daemon serves on, the model included.
    plain = openai_client.chat.completions.create(model="llm", messages=ASK, max_tokens=2)
    assert plain.choices[0].message.content is not None


@pytest.mark.parametrize(
    "schema", [{"type": "frobnicate"}, {"type": "string", "pattern": "[a-z]+"}, {"$ref": "#/$defs/missing"}]
)
def test_a_schema_the_converter_asserts_on_is_a_400(openai_client: Any, schema: dict[str, Any]) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.chat.completions.create(model="llm", messages=ASK, max_tokens=4, response_format=_schema(schema))
    assert refused.value.code == "invalid_input"


def test_tools_are_refused_by_name_and_only_them(openai_client: Any) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.chat.completions.create(
            model="llm",
            messages=ASK,
            max_tokens=4,
            tools=[WEATHER],
            tool_choice="required",
            response_format={"type": "json_object"},
            logprobs=True,
            top_logprobs=1,
        )
    e = refused.value
    assert e.code == "bad_request" and e.type == "bad_request"
    assert "tool_choice, tools: not supported" in e.message, e.message
    assert "response_format" not in e.message and "logprobs" not in e.message


def test_triton_generate_takes_a_format_and_refuses_logprobs(edge: DaemonProcess) -> None:
    with http(edge) as c:
        fmt = _schema(PERSON)
        r = c.post("/v2/models/llm/generate", json={"text_input": "Me:", "max_tokens": 200, "response_format": fmt})
        assert r.status_code == 200, r.text
        assert set(json.loads(r.json()["text_output"])) == {"name", "age", "pets"}
        r = c.post("/v2/models/llm/generate", json={"text_input": "Hi", "parameters": {"logprobs": 2}})
        assert r.status_code == 400 and r.json()["code"] == "bad_request" and "logprobs" in r.json()["error"]
        costly = {"text_input": "Hi", "response_format": _schema({"type": "string", "maxLength": 50000})}
        r = c.post("/v2/models/llm/generate_stream", json=costly)
        assert r.status_code == 400 and "maxLength" in r.json()["error"]


def test_mqtt_serves_json_and_refuses_logprobs(module_broker: Broker, edge: DaemonProcess) -> None:
    with Peer(module_broker.port) as peer:
        reply = f"reply/{uuid.uuid4().hex}"
        peer.subscribe(reply)
        request = {"prompt": "Hi", "max_tokens": 3, "response_format": {"type": "json_object"}, "logprobs": True}
        peer.request(f"edged/{DEV}/models/llm/generate", json.dumps(request), reply, b"s", "application/json")
        doc = peer.first(reply, timeout=60).json()
        assert doc["final"] is True and doc["code"] == "bad_request"
        assert doc["error"].startswith("logprobs: served over HTTP"), doc["error"]
        # The same grammar as HTTP's: the streamed text is one JSON object.
        reply = f"reply/{uuid.uuid4().hex}"
        peer.subscribe(reply)
        ask = [{"role": "user", "content": 'Reply with exactly this JSON and nothing else: {"ok": true}'}]
        request = {"messages": ask, "max_tokens": 120, "temperature": 0, "response_format": {"type": "json_object"}}
        peer.request(f"edged/{DEV}/models/llm/generate", json.dumps(request), reply, b"j", "application/json")
        peer.first(reply, lambda r: r.json()["final"], timeout=120)
        docs = [m.json() for m in peer.on(reply)]
    assert docs[-1].get("finish_reason") == "stop", docs[-1]
    assert isinstance(json.loads("".join(d["text"] for d in docs)), dict)
