"""One generation inside the batched context: its tokens, its sampler chain, its text.

Everything per request lives here so that sequences sharing one ``llama_decode`` never share
state: each has its own sampler chain (temperature, top-p, seed, grammar), its own UTF-8 decoder
and stop matcher, and the positions of its own cells in the KV cache.
"""

from __future__ import annotations

import codecs
import ctypes
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import llama_cpp
import numpy as np

from edged.errors import InvalidInputError
from edged.llm.generation import GenerationJob, Sampling, StopMatcher


@dataclass(eq=False)
class Sequence:
    job: GenerationJob
    prompt: list[int]
    sampler: Any  # a llama_sampler chain, freed by the engine when the sequence ends
    grammar: Any = None  # the response format's grammar sampler, freed with the chain
    seq_id: int = -1
    pos: int = 0  # cells of this sequence in the KV cache (positions 0 .. pos-1)
    history: list[int] = field(default_factory=list)  # the tokens of those cells
    pending: list[int] = field(default_factory=list)  # prompt tokens still to prefill
    next_token: int = -1  # sampled, fed at ``pos`` by the next step
    started: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.text = TextOut(self.job)


class TextOut:
    """Token pieces to text: multi-byte characters completed, stop strings held back and cut."""

    def __init__(self, job: GenerationJob) -> None:
        self.job = job
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stops = StopMatcher(job.sampling.stop)
        self.parts: list[str] = []
        self.stopped = False

    def feed(self, piece: bytes) -> bool:
        """Emit a token's bytes; True when a stop string was reached."""
        text, self.stopped = self.stops.feed(self.decoder.decode(piece))
        self._emit(text)
        return self.stopped

    def finish(self) -> str:
        if not self.stopped:  # text held back as a possible stop string was not one after all
            self._emit(self.stops.flush() + self.decoder.decode(b"", final=True))
        return "".join(self.parts)

    def _emit(self, piece: str) -> None:
        if not piece:
            return
        self.parts.append(piece)
        if self.job.emit is not None:
            self.job.emit(piece)


def sampler_chain(sampling: Sampling, seed: int, n_vocab: int, context: int) -> Any:
    """A request's own chain, in llama-server's order: logit bias, penalties, then top-p,
    temperature and a seeded draw; greedy at temperature 0."""
    for token, _ in sampling.logit_bias:
        if token >= n_vocab:
            raise InvalidInputError(f"'logit_bias' names token {token}; this model's vocabulary has {n_vocab}")
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    if sampling.logit_bias:
        entries = [llama_cpp.llama_logit_bias(token, bias) for token, bias in sampling.logit_bias]
        biases = (llama_cpp.llama_logit_bias * len(entries))(*entries)
        # llama.cpp copies the array: it need not outlive this call.
        llama_cpp.llama_sampler_chain_add(
            chain, llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(sampling.logit_bias), biases)
        )
    if penalised(sampling):
        # Over the whole context: OpenAI's penalties count every token generated so far.
        llama_cpp.llama_sampler_chain_add(
            chain,
            llama_cpp.llama_sampler_init_penalties(
                n_vocab, context, 1.0, sampling.frequency_penalty, sampling.presence_penalty
            ),
        )
    if sampling.temperature <= 0.0:
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
    else:
        if sampling.top_p < 1.0:
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_p(sampling.top_p, 1))
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_temp(sampling.temperature))
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_dist(seed))
    return chain


def penalised(sampling: Sampling) -> bool:
    """Whether the chain keeps a history of drawn tokens (so only kept tokens may be accepted)."""
    return sampling.presence_penalty != 0.0 or sampling.frequency_penalty != 0.0


def grammar_sampler(vocab: Any, grammar: str) -> Any:
    """The grammar as a sampler of its own (None for plain text): the engine asks it about the
    token the chain drew, and only when that token is not allowed filters the whole vocabulary
    with it and draws again, as llama.cpp's own server does; filtering every step costs the
    grammar's walk over every token."""
    if not grammar:
        return None
    g = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
    if not g:
        raise InvalidInputError("the response format cannot be turned into a grammar")
    return g


class Candidates:
    """The whole vocabulary as llama.cpp's candidate array, reused by every redraw of a
    sequence's engine."""

    def __init__(self, n_vocab: int) -> None:
        dtype = np.dtype([("id", np.intc), ("logit", np.single), ("p", np.single)], align=True)
        self.data = np.zeros((n_vocab,), dtype=dtype)
        self.ids = np.arange(n_vocab, dtype=np.intc)
        self.array = llama_cpp.llama_token_data_array(
            data=self.data.ctypes.data_as(llama_cpp.llama_token_data_p), size=n_vocab, selected=-1, sorted=False
        )
        self.one = np.zeros((1,), dtype=dtype)
        self.single = llama_cpp.llama_token_data_array(
            data=self.one.ctypes.data_as(llama_cpp.llama_token_data_p), size=1, selected=-1, sorted=False
        )

    def allows(self, grammar: Any, token: int) -> bool:
        """Whether the grammar, in its current state, lets ``token`` come next."""
        self.one["id"], self.one["logit"], self.one["p"] = token, 0.0, 0.0
        self.single.size, self.single.selected, self.single.sorted = 1, -1, False
        llama_cpp.llama_sampler_apply(grammar, ctypes.byref(self.single))
        return bool(np.isfinite(self.one["logit"][0]))

    def draw(self, chain: Any, logits: np.ndarray) -> int:
        """A token drawn by ``chain`` from ``logits``, not yet accepted into its history."""
        self._fill(logits)
        llama_cpp.llama_sampler_apply(chain, ctypes.byref(self.array))
        return int(self.data["id"][self.array.selected])

    def _fill(self, logits: np.ndarray) -> None:
        self.data["id"] = self.ids
        self.data["logit"] = logits
        self.data["p"] = 0.0
        self.array.size, self.array.selected, self.array.sorted = len(self.ids), -1, False

    def redraw(self, grammar: Any, chain: Any, logits: np.ndarray) -> int:
        """A token drawn by ``chain`` from what ``grammar`` allows of ``logits``."""
        self._fill(logits)
        llama_cpp.llama_sampler_apply(grammar, ctypes.byref(self.array))
        llama_cpp.llama_sampler_apply(chain, ctypes.byref(self.array))
        return int(self.data["id"][self.array.selected])


def grammar_of(response_format: tuple[str, str] | None) -> str:
    """The GBNF grammar of OpenAI's ``response_format`` ('' for plain text). llama.cpp's own JSON
    grammar and its JSON-schema converter, which llama-cpp-python ships."""
    if response_format is None:
        return ""
    from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

    kind, schema = response_format
    if kind == "json_object":
        return str(JSON_GBNF)
    try:
        return json_safe(str(json_schema_to_gbnf(schema)))
    except Exception as e:  # the converter refuses with assertions, and KeyError, ValueError...
        raise InvalidInputError(f"'response_format' schema is not one llama.cpp can follow: {e}") from e


# llama-cpp-python's schema converter lets a string's character, and a pattern's '.', be any
# character, where JSON forbids raw control characters in a string and a raw '"' or '\\' ends or
# escapes it: a schema's string came back holding a raw newline, which no JSON parser takes.
# Those two rules, recognised by their exact bodies (a property's rule may be named "char" too),
# get the character class llama.cpp's own JSON grammar uses.
_JSON_STRING_CHAR = r'[^"\\\x7F\x00-\x1F]'
_UNSAFE_BODIES = {
    r'[^"\\] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])': _JSON_STRING_CHAR
    + r' | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])',
    r"[^\x0A\x0D]": _JSON_STRING_CHAR,
}


def json_safe(grammar: str) -> str:
    """``grammar`` with the converter's string characters limited to what JSON lets a string hold."""
    lines = []
    for line in grammar.splitlines():
        name, sep, body = line.partition(" ::= ")
        if sep and body in _UNSAFE_BODIES:
            line = f"{name} ::= {_UNSAFE_BODIES[body]}"
        lines.append(line)
    return "\n".join(lines)


def logprob_entry(logits: np.ndarray, token: int, top: int, piece: Any) -> dict[str, Any]:
    """OpenAI's per-token record from a step's raw logits: the chosen token's log probability
    and the ``top`` most likely alternatives'."""
    shifted = logits.astype(np.float64) - float(logits.max())
    logz = float(np.log(np.exp(shifted).sum()))
    entry = _token(piece(token), float(shifted[token]) - logz)
    if top > 0:
        best = np.argpartition(-shifted, top)[:top]
        best = best[np.argsort(-shifted[best])]
        entry["top_logprobs"] = [_token(piece(int(t)), float(shifted[t]) - logz) for t in best]
    else:
        entry["top_logprobs"] = []
    return entry


def _token(raw: bytes, logprob: float) -> dict[str, Any]:
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}
