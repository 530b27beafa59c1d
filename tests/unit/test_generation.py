"""Pure logic of generation requests: stop strings over streamed text, parameter checks."""

from __future__ import annotations

import pytest

from edged.config import LlmConfig, ModelConfig
from edged.errors import InvalidInputError
from edged.llm.generation import MAX_LOGIT_BIAS, StopMatcher, is_language_model, make_job, messages_from, sampling_from


def run(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    m = StopMatcher(stops)
    out = []
    for p in pieces:
        text, stopped = m.feed(p)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + m.flush(), False


def test_stop_string_across_pieces_is_cut_and_never_shown() -> None:
    assert run(["</s>"], ["Hello <", "/", "s> more"]) == ("Hello ", True)
    m = StopMatcher(["END"])
    assert m.feed("abcE") == ("abc", False)  # "E" could start "END": held back
    assert m.feed("x") == ("Ex", False)  # it did not


def test_no_stop_strings_pass_text_through() -> None:
    assert run([], ["a", "b"]) == ("ab", False)
    assert run(["zz"], ["a", "z"]) == ("az", False)  # held "z" is flushed at the end


def test_sampling_defaults_and_bounds() -> None:
    llm = LlmConfig(max_tokens=64, max_tokens_limit=128, temperature=0.5, stop=["\n\n"])
    s = sampling_from({}, llm)
    assert (s.max_tokens, s.temperature, s.stop, s.max_tokens_explicit) == (64, 0.5, ("\n\n",), False)
    s = sampling_from({"max_tokens": 10, "stop": "x", "seed": 3, "top_p": 0.5}, llm)
    assert (s.max_tokens, s.stop, s.seed, s.top_p, s.max_tokens_explicit) == (10, ("x",), 3, 0.5, True)
    for bad in ({"max_tokens": 129}, {"max_tokens": 0}, {"temperature": 3}, {"stop": ["a"] * 5}, {"seed": -1}):
        with pytest.raises(InvalidInputError):
            sampling_from(bad, llm)
    with pytest.raises(InvalidInputError, match="n = 1"):
        sampling_from({"n": 2}, llm)


def test_logit_bias_and_penalties_are_read_and_bounded() -> None:
    llm = LlmConfig()
    s = sampling_from({"logit_bias": {"7": -100, "3": 2.5}, "presence_penalty": -1, "frequency_penalty": 0.5}, llm)
    assert (s.logit_bias, s.presence_penalty, s.frequency_penalty) == (((3, 2.5), (7, -100.0)), -1.0, 0.5)
    assert sampling_from({}, llm).logit_bias == ()
    too_many = {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}
    for bad in (
        {"logit_bias": too_many},
        {"logit_bias": {"-1": 1}},
        {"logit_bias": {"1e3": 1}},
        {"logit_bias": {"٣": 1}},  # a digit, but not an ASCII one
        {"logit_bias": {"1": True}},
        {"logit_bias": {"1": -100.5}},
        {"presence_penalty": -2.01},
        {"frequency_penalty": True},
    ):
        with pytest.raises(InvalidInputError):
            sampling_from(bad, llm)


def test_messages_are_checked() -> None:
    msgs = messages_from([{"role": "developer", "content": [{"type": "text", "text": "be brief"}]}])
    assert msgs == [{"role": "system", "content": "be brief"}]
    for bad in ([], [{"role": "tool", "content": "x"}], [{"role": "user", "content": 3}], "hi"):
        with pytest.raises(InvalidInputError):
            messages_from(bad)


def test_prompt_longer_than_the_context_can_hold_is_refused_before_tokenising() -> None:
    model = ModelConfig(path="m.gguf", llm=LlmConfig(context=64, max_tokens=8, max_tokens_limit=16))
    assert is_language_model(model) and not is_language_model(ModelConfig(path="m.onnx"))
    with pytest.raises(InvalidInputError, match="cannot fit"):
        make_job(model, {}, 10.0, prompt="x" * 64 * 17)
    job = make_job(model, {}, 10.0, prompt="hello")
    assert job.context == 64 and job.sampling.max_tokens == 8


def test_llm_table_sets_slots_as_instances_and_is_validated() -> None:
    from pathlib import Path

    from edged.config import from_mapping
    from edged.errors import ConfigError

    cfg = from_mapping({"models": {"m": {"path": "m.gguf", "llm": {"slots": 3}}}}, "t.toml", Path("/x"))
    assert cfg.models["m"].instances == 3 and cfg.models["m"].llm is not None
    bad = [
        ({"slots": 2}, {"instances": 3}, "instances"),
        ({"max_tokens": 300, "max_tokens_limit": 200}, {}, "llm.max_tokens"),
        ({"context": 256, "max_tokens_limit": 256}, {}, "max_tokens_limit"),
        ({"slots": 4}, {"queue_depth": 2}, "queue_depth"),
        ({"temperature": 5}, {}, "llm.temperature"),
    ]
    for llm, model, key in bad:
        with pytest.raises(ConfigError, match=key):
            from_mapping({"models": {"m": {"path": "m.gguf", "llm": llm, **model}}}, "t.toml", Path("/x"))
