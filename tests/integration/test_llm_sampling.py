"""OpenAI's logit_bias, presence_penalty and frequency_penalty with the official ``openai``
client and the real SmolLM2-135M served by the real daemon (test_llm's daemon and client). Each
test compares two answers to the same greedy request, so it checks what a parameter changes,
never what the model writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_llm import COUNTING, edge, module_broker, openai_client, smollm2, tcp_port

pytestmark = pytest.mark.integration

__all__ = ["edge", "module_broker", "openai_client", "smollm2", "tcp_port"]  # fixtures pytest finds here


def _token_id(gguf: Path, text: str) -> int:
    from llama_cpp import Llama

    vocab = Llama(str(gguf), vocab_only=True, verbose=False)
    ids = vocab.tokenize(text.encode(), add_bos=False, special=False)
    assert len(ids) == 1, ids
    return int(ids[0])


def _complete(client: Any, prompt: str = COUNTING, max_tokens: int = 16, **extra: Any) -> tuple[str, list[str]]:
    out = client.completions.create(
        model="llm", prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=0, extra_body=extra
    )
    choice = out.choices[0]
    return choice.text, list(choice.logprobs.tokens)


def test_logit_bias_forces_and_forbids_a_token(openai_client: Any, smollm2: Path) -> None:
    cat = _token_id(smollm2, " cat")
    text, _ = _complete(openai_client, logit_bias={str(cat): 100})
    assert text == " cat" * 16
    # Sampled, not greedy, and streamed over chat: the bias still decides every token.
    chunks = openai_client.chat.completions.create(
        model="llm",
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=6,
        temperature=1.0,
        seed=5,
        stream=True,
        logit_bias={str(cat): 100},
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == " cat" * 6
    # Forbidding the greedy answer's first token changes that token and keeps it out.
    plain, tokens = _complete(openai_client)
    first = _token_id(smollm2, tokens[0])
    banned, banned_tokens = _complete(openai_client, logit_bias={str(first): -100})
    assert banned_tokens[0] != tokens[0] and tokens[0] not in banned_tokens, (plain, banned)


STORY = "Once upon a time, in a small village by the sea,"


@pytest.mark.parametrize("key", ["frequency_penalty", "presence_penalty"])
def test_penalties_make_a_greedy_answer_repeat_itself_less(openai_client: Any, key: str) -> None:
    plain, tokens = _complete(openai_client, prompt=STORY, max_tokens=48)
    penalised, penalised_tokens = _complete(openai_client, prompt=STORY, max_tokens=48, **{key: 2.0})
    assert penalised != plain
    repeats = len(tokens) - len(set(tokens))
    assert len(penalised_tokens) - len(set(penalised_tokens)) < repeats, (plain, penalised)


def test_penalties_keep_a_response_format(openai_client: Any) -> None:
    # The grammar's refused draws never enter the penalties' history; the answer stays JSON.
    out = openai_client.chat.completions.create(
        model="llm",
        messages=[{"role": "user", "content": 'Reply with exactly this JSON and nothing else: {"ok": true}'}],
        max_tokens=120,
        temperature=0,
        frequency_penalty=1.0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(out.choices[0].message.content), dict)


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"logit_bias": {"99999999": 5}}, "vocabulary has"),
        ({"logit_bias": {"cat": 5}}, "token ids"),
        ({"logit_bias": {"5": 101}}, "[-100, 100]"),
        ({"logit_bias": [1, 2]}, "object"),
        ({"presence_penalty": 2.5}, "'presence_penalty'"),
        ({"frequency_penalty": "high"}, "'frequency_penalty'"),
    ],
)
def test_bad_sampling_parameters_are_a_400_naming_them(openai_client: Any, extra: dict[str, Any], says: str) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        openai_client.completions.create(model="llm", prompt="hi", max_tokens=2, extra_body=extra)
    assert says in str(err.value)
