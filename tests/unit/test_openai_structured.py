"""The OpenAI routes' structured output and log probabilities, as pure logic: which schemas are
refused before they become a grammar, and how a job's per-token entries become the chat form and
the completions' legacy form, whole or chunk by chunk."""

from __future__ import annotations

from typing import Any

import pytest

from edged.errors import BadRequestError, InvalidInputError
from edged.llm.generation import GenerationJob, Sampling, response_format_from
from edged.llm.schema import MAX_REPEAT, MAX_SCHEMA_DEPTH, costly_schema
from edged.transports.http.openai import LogprobsOut, refuse_unsupported, unsupported


def _fmt(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def _nested(depth: int) -> dict[str, Any]:
    """Arrays of arrays: ``depth`` objects, each inside the one before."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"name": {"type": "string", "maxLength": MAX_REPEAT}}, "required": ["name"]},
        {"type": "array", "items": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"}, "maxItems": 10},
        {"type": "string", "pattern": "^a{2,}b{0,10}$"},
        # A property named like a keyword is a schema, not a bound.
        {"type": "object", "properties": {"maxLength": {"type": "integer"}, "pattern": {"type": "string"}}},
        _nested(MAX_SCHEMA_DEPTH),
    ],
)
def test_schemas_of_ordinary_size_pass(schema: dict[str, Any]) -> None:
    assert costly_schema(schema) == ""
    assert response_format_from(_fmt(schema)) is not None


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"type": "string", "maxLength": 20000}, "maxLength is 20000"),
        ({"type": "string", "minLength": 10**9}, "minLength is 1000000000"),
        ({"type": "string", "maxLength": 20000.0}, "maxLength is 20000.0"),
        ({"type": "object", "properties": {"ids": {"type": "array", "maxItems": 5000}}}, "properties.ids.maxItems"),
        ({"anyOf": [{"type": "null"}, {"type": "array", "minItems": 1001}]}, "anyOf[1].minItems"),
        ({"type": "string", "pattern": "^a{0,20000}$"}, "pattern repeats 20000 times"),
        ({"type": "string", "pattern": "^(a{0,600}b{600})$"}, "pattern repeats 1200 times"),
        (_nested(MAX_SCHEMA_DEPTH + 1), f"nests deeper than {MAX_SCHEMA_DEPTH} levels"),
        # The converter drops numeric bounds without a word: refused rather than served unenforced.
        ({"type": "integer", "minimum": 0, "maximum": 10**9}, "minimum is not enforced by the grammar"),
        (
            {"type": "object", "properties": {"n": {"type": "number", "exclusiveMaximum": 1}}},
            "properties.n.exclusiveMaximum",
        ),
    ],
)
def test_schemas_that_would_expand_past_a_grammar_are_named(schema: dict[str, Any], named: str) -> None:
    assert named in costly_schema(schema)
    # Every transport reads the format through response_format_from: refused there, for all.
    with pytest.raises(InvalidInputError, match="'response_format' schema: "):
        response_format_from(_fmt(schema))


def test_formats_without_a_schema_object_are_refused_or_plain() -> None:
    assert response_format_from(None) is None and response_format_from({"type": "text"}) is None
    assert response_format_from({"type": "json_object"}) == ("json_object", "")
    for fmt in (_fmt("a string"), {"type": "json_schema"}):
        with pytest.raises(InvalidInputError, match="must be a JSON schema object"):
            response_format_from(fmt)


def test_structured_output_and_logprobs_are_no_longer_refused_but_tools_are() -> None:
    body = {"response_format": {"type": "json_object"}, "logprobs": True, "top_logprobs": 3}
    assert unsupported(body) == []
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    with pytest.raises(BadRequestError, match="^tool_choice, tools: not supported"):
        refuse_unsupported(dict(body, tools=tools, tool_choice="required"))


def _entry(token: bytes, logprob: float, alternatives: list[tuple[bytes, float]]) -> dict[str, Any]:
    def one(raw: bytes, lp: float) -> dict[str, Any]:
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(raw)}

    return dict(one(token, logprob), top_logprobs=[one(r, lp) for r, lp in alternatives])


def _job(top: int) -> GenerationJob:
    return GenerationJob(sampling=Sampling(16, 0.0, 1.0, logprobs=top))


def test_chat_form_hands_out_each_counted_entry_once() -> None:
    job = _job(1)
    out = LogprobsOut(job, chat=True)
    assert out.take() is None and out.take(always=True) == {"content": [], "refusal": None}
    job.token_logprobs.append(_entry(b"Hi", -0.5, [(b"Hi", -0.5)]))
    assert out.take() is None  # appended, not counted yet: held for the next chunk
    job.completion_tokens = 1
    first = out.take()
    assert first is not None and [e["token"] for e in first["content"]] == ["Hi"]
    assert out.take() is None
    job.token_logprobs.append(_entry(b"!", -0.1, [(b"!", -0.1)]))
    job.completion_tokens = 2
    job.token_logprobs.append(_entry(b"", -0.01, [(b"", -0.01)]))  # the end-of-text token: never counted
    rest = out.take()
    assert rest is not None and [e["token"] for e in rest["content"]] == ["!"]
    assert out.take() is None


def test_no_logprobs_asked_is_none_even_for_a_whole_answer() -> None:
    job = _job(-1)
    job.completion_tokens = 3
    assert LogprobsOut(job, chat=True).take(always=True) is None
    assert LogprobsOut(job, chat=False).take(always=True) is None


def test_legacy_form_offsets_count_characters_from_the_prompt() -> None:
    job = _job(2)
    # "é" is two bytes split over two tokens: its second token starts where its first did.
    pieces = [
        _entry(b" caf", -0.2, [(b" caf", -0.2), (b" cat", -1.9)]),
        _entry(b"\xc3", -0.3, [(b"\xc3", -0.3), (b"e", -2.0)]),
        _entry(b"\xa9", -0.1, [(b"\xa9", -0.1), (b"\xa8", -3.0)]),
        _entry(b"!", -2.5, [(b".", -0.4), (b",", -1.5)]),  # sampled, not among the two most likely
    ]
    out = LogprobsOut(job, chat=False, offset=len("Say"))
    job.token_logprobs.extend(pieces[:2])
    job.completion_tokens = 2
    head = out.take()
    job.token_logprobs.extend(pieces[2:])
    job.completion_tokens = 4
    tail = out.take()
    assert head is not None and tail is not None
    assert head["text_offset"] + tail["text_offset"] == [3, 7, 7, 8]
    assert head["token_logprobs"] + tail["token_logprobs"] == [-0.2, -0.3, -0.1, -2.5]
    assert tail["tokens"][1] == "!"
    # The two most likely, then the sampled token when it is not one of them.
    assert tail["top_logprobs"][1] == {".": -0.4, ",": -1.5, "!": -2.5}
    # Two tokens that read the same (each half a character): the more likely one stays.
    assert tail["top_logprobs"][0] == {"\ufffd": -0.1}
