"""Kept prefixes in the batched context: reused, saved to the engine cache, restored and checked.

The engine's thread calls every method here between two steps: the context is never touched by
two threads. Writing a saved state to disk is the one thing done elsewhere (a writer thread), on
bytes already copied out of the context.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import llama_cpp
import numpy as np

from edged.backends.llama import statefile
from edged.backends.llama.prefixes import Prefix, PrefixTable, token_digest
from edged.config import LlmConfig
from edged.errors import BackendError

log = logging.getLogger(__name__)

CHECK_LOGITS = 8  # next-token logits a saved state must reproduce
# Restored cells hold the saved f16 values, but not in the places the original cells had: llama.cpp's
# CPU attention sums the values in f16 in cell order, so a chat whose cells were scattered among
# other sequences' gives logits that differ by a few percent (0.6 in 17 seen). Foreign or damaged
# cells give unrelated or non-finite logits.
CHECK_ABS, CHECK_REL = 0.25, 0.05


class Context(Protocol):
    """What the keeper uses of the engine: its context, its cache, its batch."""

    name: str
    llm: LlmConfig
    ctx: Any
    memory: Any
    batch: Any
    capacity: int
    n_vocab: int
    free_ids: list[int]

    def put(self, i: int, token: int, pos: int, seq_id: int, logits: bool) -> None: ...


class PrefixKeeper:
    def __init__(self, engine: Context, ids: Iterable[int]) -> None:
        self.e = engine
        self.prefixes = PrefixTable(tuple(ids), engine.llm.prefix_cache_tokens)
        self.states: Path | None = None  # where saved states live; None: nothing is saved
        self.binding: dict[str, Any] = {}  # what a saved state must have been made for
        self.system: list[int] = []  # the system prompt's tokens, kept pinned
        self.restored = 0
        self._writer = ThreadPoolExecutor(1, thread_name_prefix=f"llm-{engine.name}-save")

    def close(self) -> None:
        self._writer.shutdown(wait=True)

    def reuse(self, prompt: list[int], seq_id: int) -> int:
        """Give sequence ``seq_id`` the cells of the kept prefix that ``prompt`` starts with;
        returns how many prompt tokens it need not prefill."""
        prefix, n = self.prefixes.match(prompt)
        if prefix is not None:
            llama_cpp.llama_memory_seq_cp(self.e.memory, prefix.seq_id, seq_id, 0, n)
            self._maybe_save(prefix)
        return n

    def keep(self, source: int, tokens: list[int]) -> None:
        """Keep a finished sequence's cells (the chat so far) for a request that continues it."""
        placed = self.prefixes.place(tokens)
        if placed is None:
            return
        seq_id, dropped = placed
        for p in dropped:
            llama_cpp.llama_memory_seq_rm(self.e.memory, p.seq_id, -1, -1)
        llama_cpp.llama_memory_seq_cp(self.e.memory, source, seq_id, 0, len(tokens))

    def drop(self) -> bool:
        """Free every kept prefix but the pinned ones; whether any was dropped. The cells of the
        running sequences are sized to fit, so this only matters when kept prefixes and
        fragmentation together leave a step no room."""
        dropped = [p for p in self.prefixes.entries.values() if not p.pinned]
        for p in dropped:
            llama_cpp.llama_memory_seq_rm(self.e.memory, p.seq_id, -1, -1)
            self.prefixes.remove(p)
        if dropped:
            log.info("%s: dropped %d kept prefixes to make room for a step", self.e.name, len(dropped))
        return bool(dropped)

    def prime(self) -> None:
        restored = self._restore() if self.states is not None else 0
        system = self.system
        if system and len(system) >= 2 and self.prefixes.find(system) is None:
            started = time.monotonic()
            placed = self.prefixes.place(system, pinned=True)
            if placed is None:
                log.warning(
                    "%s: the system prompt (%d tokens) does not fit prefix_cache_tokens", self.e.name, len(system)
                )
                return
            seq_id, _ = placed
            self._prefill(seq_id, system)
            prefix = self.prefixes.entries[seq_id]
            log.info(
                "%s: system prompt prefilled (%d tokens, %.0f ms)",
                self.e.name,
                len(system),
                (time.monotonic() - started) * 1000,
            )
            self._save(prefix)
        elif system and (p := self.prefixes.find(system)) is not None:
            p.pinned = True
        self.restored = restored
        if restored:
            log.info("%s: %d saved prefixes restored and verified", self.e.name, restored)

    def _prefill(self, seq_id: int, tokens: list[int]) -> None:
        for start in range(0, len(tokens), self.e.capacity):
            part = tokens[start : start + self.e.capacity]
            for i, token in enumerate(part):
                self.e.put(i, token, start + i, seq_id, False)
            self.e.batch.n_tokens = len(part)
            rc = llama_cpp.llama_decode(self.e.ctx, self.e.batch)
            if rc != 0:
                llama_cpp.llama_memory_seq_rm(self.e.memory, seq_id, -1, -1)
                raise BackendError(f"prefilling a prefix: llama_decode returned {rc}")

    def _recompute(self, prefix: Prefix) -> np.ndarray:
        """The next-token logits of a one-token recompute on top of the prefix's cells: the last
        token decoded again on a scratch sequence that shares all the cells before it."""
        scratch = self.e.free_ids[-1]
        last = len(prefix.tokens) - 1
        llama_cpp.llama_memory_seq_cp(self.e.memory, prefix.seq_id, scratch, 0, last)
        try:
            self.e.put(0, prefix.tokens[last], last, scratch, True)
            self.e.batch.n_tokens = 1
            rc = llama_cpp.llama_decode(self.e.ctx, self.e.batch)
            if rc != 0:
                raise BackendError(f"checking a prefix: llama_decode returned {rc}")
            ptr = llama_cpp.llama_get_logits_ith(self.e.ctx, 0)
            return np.ctypeslib.as_array(ptr, shape=(self.e.n_vocab,)).copy()
        finally:
            llama_cpp.llama_memory_seq_rm(self.e.memory, scratch, -1, -1)

    def _path(self, prefix: Prefix) -> Path:
        assert self.states is not None
        return self.states / f"{prefix.digest[:32]}.kv"

    def _maybe_save(self, prefix: Prefix) -> None:
        """A prefix that a second request has reused is worth keeping across restarts."""
        if prefix.hits >= 2 and not prefix.saved and self.e.free_ids:
            self._save(prefix)

    def _save(self, prefix: Prefix) -> None:
        if self.states is None or prefix.saved or not self.e.free_ids:
            return
        saved = sum(1 for p in self.prefixes.entries.values() if p.saved)
        if saved >= self.e.llm.saved_prefixes:
            return
        prefix.saved = True
        started = time.monotonic()
        logits = self._recompute(prefix)
        top = [(int(t), float(logits[t])) for t in np.argsort(-logits)[:CHECK_LOGITS]]
        size = llama_cpp.llama_state_seq_get_size(self.e.ctx, prefix.seq_id)
        buf = (ctypes.c_uint8 * size)()
        got = llama_cpp.llama_state_seq_get_data(self.e.ctx, buf, size, prefix.seq_id)
        state = statefile.SavedState(prefix.tokens, bytes(memoryview(buf)[:got]), tuple(top))
        path, keep = self._path(prefix), {self._path(p) for p in self.prefixes.entries.values() if p.saved}
        log.info(
            "%s: saving a prefix of %d tokens (%d KiB, %.0f ms to copy)",
            self.e.name,
            len(prefix.tokens),
            got >> 10,
            (time.monotonic() - started) * 1000,
        )
        self._writer.submit(self._write, path, state, keep)

    def _write(self, path: Path, state: statefile.SavedState, keep: set[Path]) -> None:
        try:
            statefile.write(path, self.binding, state)
            for old in statefile.saved_files(path.parent)[self.e.llm.saved_prefixes :]:
                if old not in keep and old != path:
                    old.unlink(missing_ok=True)
        except OSError as e:
            log.warning("%s: cannot save a prefix state to %s: %s", self.e.name, path, e)

    def _restore(self) -> int:
        """Restore and check every saved prefix. A state that fails its check may have left
        non-finite values in cells that attention still reads (masked weights are zeros, and
        zero times NaN is NaN), so after a failure the cache is wiped, values included, and the
        states that passed are restored again; the failed one is in the quarantine by then."""
        for _ in range(self.e.llm.saved_prefixes + 1):
            restored, failed = self._restore_all()
            if not failed:
                return restored
            llama_cpp.llama_memory_clear(self.e.memory, True)
            self.prefixes = PrefixTable(self.prefixes.ids, self.e.llm.prefix_cache_tokens)
        return 0

    def _restore_all(self) -> tuple[int, bool]:
        assert self.states is not None
        restored = 0
        limit = self.e.llm.prefix_cache_tokens << 20  # a MiB a token: far above any model's KV
        files = statefile.saved_files(self.states)[: self.e.llm.saved_prefixes]
        # The system prompt's state first: it then lands in the cells it was saved from (the first
        # ones), and every chat's recompute sums in the order it was saved with.
        system = self.states / f"{token_digest(self.system)[:32]}.kv" if self.system else None
        files.sort(key=lambda path: path != system)
        for path in files:
            started = time.monotonic()
            try:
                saved = statefile.read(path, self.binding, limit)
            except statefile.StateFileError as e:
                statefile.quarantine(path, str(e))
                continue
            placed = self.prefixes.place(saved.tokens, pinned=list(saved.tokens) == self.system)
            if placed is None:
                continue
            prefix = self.prefixes.entries[placed[0]]
            why = self._load_state(prefix, saved)
            if why:
                statefile.quarantine(path, why)
                log.warning("%s: a saved prefix failed its check (%s); it is prefilled again", self.e.name, why)
                return 0, True
            prefix.saved = True
            restored += 1
            log.info(
                "%s: restored a prefix of %d tokens in %.0f ms (%s)",
                self.e.name,
                len(saved.tokens),
                (time.monotonic() - started) * 1000,
                token_digest(saved.tokens)[:12],
            )
        return restored, False

    def _load_state(self, prefix: Prefix, saved: statefile.SavedState) -> str:
        """'' when the state restored into ``prefix`` is the one saved, else why not."""
        buf = (ctypes.c_uint8 * len(saved.state)).from_buffer_copy(saved.state)
        if llama_cpp.llama_state_seq_set_data(self.e.ctx, buf, len(saved.state), prefix.seq_id) == 0:
            return "llama.cpp refused the state"
        lo = llama_cpp.llama_memory_seq_pos_min(self.e.memory, prefix.seq_id)
        hi = llama_cpp.llama_memory_seq_pos_max(self.e.memory, prefix.seq_id)
        if (lo, hi) != (0, len(saved.tokens) - 1):
            return f"restored positions {lo}..{hi}, the prefix has {len(saved.tokens)} tokens"
        got = self._recompute(prefix)
        for token, want in saved.logits:
            have = float(got[token]) if 0 <= token < self.e.n_vocab else float("nan")
            if not abs(have - want) <= CHECK_ABS + CHECK_REL * abs(want):
                return f"next-token logits differ from the saved ones (token {token}: {have:.4f} vs {want:.4f})"
        return ""
