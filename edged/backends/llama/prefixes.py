"""Kept prompt prefixes: which token sequences stay in the KV cache for later requests to reuse.

A prefix lives in the shared (unified) KV cache under a sequence id of its own. A request whose
prompt starts with it gets those cells by ``llama_memory_seq_cp``, which in a unified cache tags
the cells with one more sequence id instead of copying them, so reuse is free and the prefix is
stored once however many sequences share it. This module is the bookkeeping only (which id holds
which tokens, what to evict); the engine does the llama.cpp calls. Every cost is linear in the
prompt and the number of kept prefixes, both bounded.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

# A shorter shared prefix is not worth a cache id: prefilling it costs less than bookkeeping.
MIN_PREFIX = 32


@dataclass(eq=False)
class Prefix:
    seq_id: int
    tokens: tuple[int, ...]
    pinned: bool = False  # the system prompt: never evicted
    hits: int = 0
    used: float = field(default_factory=time.monotonic)
    saved: bool = False  # its state is in the engine cache

    @property
    def digest(self) -> str:
        return token_digest(self.tokens)


def token_digest(tokens: Sequence[int]) -> str:
    return hashlib.sha256(b"".join(t.to_bytes(4, "little", signed=True) for t in tokens)).hexdigest()


def common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens ``a`` and ``b`` share from the start (compared in numpy: prompts of
    thousands of tokens against every kept prefix, on the decoding thread)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(differ[0]) if differ.size else n


class PrefixTable:
    """Up to ``len(ids)`` kept prefixes holding at most ``budget`` tokens in all."""

    def __init__(self, ids: Sequence[int], budget: int) -> None:
        self.budget = budget
        self.ids = tuple(ids)
        self._free = list(reversed(self.ids))
        self.entries: dict[int, Prefix] = {}

    @property
    def tokens(self) -> int:
        return sum(len(p.tokens) for p in self.entries.values())

    def match(self, prompt: Sequence[int]) -> tuple[Prefix | None, int]:
        """The kept prefix sharing the longest start with ``prompt``, and how many tokens of it
        to reuse: at most all but the prompt's last token, whose logits a step must compute."""
        best, length = None, 0
        for p in self.entries.values():
            n = common_length(p.tokens, prompt)
            if n > length:
                best, length = p, n
        length = min(length, len(prompt) - 1)
        if best is None or length < MIN_PREFIX:
            return None, 0
        best.hits += 1
        best.used = time.monotonic()
        return best, length

    def find(self, tokens: Sequence[int]) -> Prefix | None:
        key = tuple(tokens)
        return next((p for p in self.entries.values() if p.tokens == key), None)

    def place(self, tokens: Sequence[int], pinned: bool = False) -> tuple[int, list[Prefix]] | None:
        """Where to keep ``tokens``: (the id to copy them into, the prefixes to drop first), or
        None when they are not worth keeping (too short, already kept, larger than the budget,
        or only pinned prefixes could make room). A kept prefix that the new one extends is
        dropped: its cells are the new one's."""
        if len(tokens) < MIN_PREFIX or len(tokens) > self.budget or self.find(tokens) is not None:
            return None
        drop = [p for p in self.entries.values() if not p.pinned and common_length(p.tokens, tokens) == len(p.tokens)]
        room = self.budget - self.tokens + sum(len(p.tokens) for p in drop)
        free = len(self._free) + len(drop)
        for p in sorted(self.entries.values(), key=lambda p: (p.hits, p.used)):
            if room >= len(tokens) and free > 0:
                break
            if p.pinned or p in drop:
                continue
            drop.append(p)
            room += len(p.tokens)
            free += 1
        if room < len(tokens) or free == 0:
            return None
        for p in drop:
            self.remove(p)
        seq_id = self._free.pop()
        self.entries[seq_id] = Prefix(seq_id, tuple(tokens), pinned=pinned)
        return seq_id, drop

    def remove(self, prefix: Prefix) -> None:
        if self.entries.pop(prefix.seq_id, None) is not None:
            self._free.append(prefix.seq_id)
