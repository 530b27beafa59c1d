"""What a GGUF file says about its model (read from the header alone), and the memory a loaded
model takes: the figure the admission plan uses."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from edged.config import LlmConfig
from edged.llm.gguf_header import read_header

# llama.cpp sizes its KV cache in multiples of this many cells.
KV_PAD = 256


@dataclass(frozen=True)
class GgufInfo:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    context_train: int
    size: int

    def kv_bytes(self, cells: int) -> int:
        """Bytes of a KV cache of ``cells`` tokens (f16 keys and values for every layer)."""
        return self.n_layer * cells * 2 * self.n_head_kv * self.head_dim * 2

    def compute_bytes(self, ubatch: int, cells: int) -> int:
        """What llama.cpp holds besides weights and KV on the CPU path, as measured (RSS after
        warm-up, SmolLM2-135M, 1-4 slots, 3-10k cells): the vocabulary's tables, a step's
        activations (flash attention keeps no score matrix of the whole cache), and per-cell
        bookkeeping of the cache. A few tens of MB for a small model: the weights and the KV
        cache are the figure's bulk, and both are exact."""
        return self.n_vocab * 400 + ubatch * self.n_embd * 64 + cells * 512

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def cells_of(llm: LlmConfig) -> int:
    """The context's KV cells: ``context`` for each slot plus the kept prefixes, padded as
    llama.cpp pads them."""
    want = llm.slots * llm.context + llm.prefix_cache_tokens
    return -(-want // KV_PAD) * KV_PAD


def step_tokens(llm: LlmConfig) -> int:
    """The most tokens one decoding step carries: a token per slot and one prefill chunk."""
    return llm.prefill_chunk + llm.slots


def footprint_of(info: GgufInfo, llm: LlmConfig) -> int:
    """Weights (mapped once), the one KV cache of every slot and kept prefix, and the compute
    buffer of a full step."""
    cells = cells_of(llm)
    return info.size + info.kv_bytes(cells) + info.compute_bytes(step_tokens(llm), cells)


@lru_cache(maxsize=32)
def _read_info(path: str, mtime_ns: int, size: int) -> GgufInfo:
    keys = read_header(path)
    arch = str(keys.get("general.architecture", ""))
    n_embd = int(keys.get(f"{arch}.embedding_length", 0))
    n_head = int(keys.get(f"{arch}.attention.head_count", 1))
    head_dim = int(keys.get(f"{arch}.attention.key_length", 0)) or n_embd // max(n_head, 1)
    return GgufInfo(
        arch=arch,
        n_layer=int(keys.get(f"{arch}.block_count", 0)),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=int(keys.get(f"{arch}.attention.head_count_kv", n_head)),
        head_dim=head_dim,
        n_vocab=int(keys.get("tokenizer.ggml.tokens", 0)),
        context_train=int(keys.get(f"{arch}.context_length", 0)),
        size=size,
    )


def gguf_info(path: str) -> GgufInfo:
    st = os.stat(path)
    return _read_info(path, st.st_mtime_ns, st.st_size)
