"""One llama.cpp context per language model, decoding every active sequence in one step.

This is continuous batching as llama.cpp's own server does it. The context has ``n_seq_max =
slots + kept prefixes`` and one *unified* KV cache of ``slots x context + prefix_cache_tokens``
cells. Unified, because then a prefix that several sequences share is stored once and handed to
a new sequence by ``llama_memory_seq_cp`` without a copy; sized per slot, because then each
request keeps the guarantee it has always had (its prompt and ``max_tokens`` within ``context``),
whatever the others do. Each step is one ``llama_decode`` holding the next token of every
decoding sequence and at most ``prefill_chunk`` prompt tokens of the sequences still
prefilling, so a long prompt delays the running streams by one chunk per step, never by its
whole prefill.

The engine's thread is the only one that touches the context. A slot's worker thread prepares
its request (template, tokens, sampler), hands the sequence over and waits for it to end;
cancellation, deadlines and unloading are checked before every step.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp._internals import LlamaContext, LlamaModel

from edged.backends.llama import statefile
from edged.backends.llama.gguf import cells_of, step_tokens
from edged.backends.llama.prefixes import Prefix, PrefixTable, token_digest
from edged.backends.llama.sequence import Sequence, logprob_entry
from edged.config import LlmConfig
from edged.errors import BackendError, DeadlineExceededError, EdgedError

log = logging.getLogger(__name__)

PREFIX_IDS = 8  # sequence ids for kept prefixes, beyond the slots'
CHECK_LOGITS = 8  # next-token logits a saved state must reproduce
CHECK_TOLERANCE = 1e-3  # restored cells are the saved f16 values: the recompute matches exactly


class BatchEngine:
    def __init__(self, name: str, source: str, llm: LlmConfig, threads: int, gpu: bool) -> None:
        self.name = name
        self.llm = llm
        mp = llama_cpp.llama_model_default_params()
        mp.n_gpu_layers = -1 if gpu else 0
        self.model = LlamaModel(path_model=source, params=mp, verbose=False)
        self.vocab = self.model.vocab
        self.n_vocab = self.model.n_vocab()
        self.capacity = step_tokens(llm)
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = cells_of(llm)
        cp.n_batch = cp.n_ubatch = self.capacity
        cp.n_seq_max = llm.slots + PREFIX_IDS
        cp.kv_unified = True
        cp.n_threads = cp.n_threads_batch = threads
        try:
            self.context = LlamaContext(model=self.model, params=cp, verbose=False)
        except Exception:
            self.model.close()
            raise
        self.ctx = self.context.ctx
        self.memory = self.context.memory
        self._batch = llama_cpp.llama_batch_init(self.capacity, 0, 1)
        self._tok = np.ctypeslib.as_array(self._batch.token, shape=(self.capacity,))
        self._pos = np.ctypeslib.as_array(self._batch.pos, shape=(self.capacity,))
        self._out = np.ctypeslib.as_array(self._batch.logits, shape=(self.capacity,))
        for i in range(self.capacity):
            self._batch.n_seq_id[i] = 1
        self._seq_cell = [self._batch.seq_id[i] for i in range(self.capacity)]
        self.prefixes = PrefixTable(range(llm.slots, llm.slots + PREFIX_IDS), llm.prefix_cache_tokens)
        self._free_ids = list(range(llm.slots - 1, -1, -1))
        self._cv = threading.Condition()
        self._inbox: list[Sequence] = []
        self._active: list[Sequence] = []
        self._closing = False
        self._writer = ThreadPoolExecutor(1, thread_name_prefix=f"llm-{name}-save")
        self._states: Path | None = None
        self._binding: dict[str, Any] = {}
        self._system: list[int] = []
        self._thread = threading.Thread(target=self._main, name=f"llm-{name}", daemon=True)
        self._piece_buf = ctypes.create_string_buffer(64)
        self.primed = threading.Event()
        self.warmed = threading.Event()  # a warm-up at request sizes has run
        self.steps = 0
        self.restored = 0  # saved prefixes restored and verified at start

    # --- the worker threads' side ---

    def start(self, states: Path | None, binding: dict[str, Any], system: list[int]) -> None:
        """Serve from now on; first restore the saved prefixes from ``states`` and keep the
        ``system`` prompt prefilled (requests wait in the inbox until that is done)."""
        self._states, self._binding, self._system = states, binding, system
        self._thread.start()

    def run(self, seq: Sequence, closing: Callable[[], bool]) -> None:
        """Run ``seq`` to its end on the engine's thread; returns when it is done."""
        with self._cv:
            if self._closing:
                raise BackendError("the model is being unloaded")
            self._inbox.append(seq)
            self._cv.notify()
        while not seq.done.wait(1.0):
            if not self._thread.is_alive():
                raise BackendError("the language model's decoding thread has stopped")

    def close(self, timeout: float) -> bool:
        """Stop the thread and free the context; False when the thread did not stop in time
        (the context is then leaked rather than freed under it)."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
        self._writer.shutdown(wait=True)
        llama_cpp.llama_batch_free(self._batch)
        self.context.close()
        self.model.close()
        return True

    # --- the engine's thread ---

    def _main(self) -> None:
        try:
            self._prime()
        except Exception:  # a prefix that cannot be kept never stops serving
            log.exception("%s: keeping the prompt prefixes failed; serving without them", self.name)
        self.primed.set()
        while True:
            with self._cv:
                while not self._closing and not self._active and not self._inbox:
                    self._cv.wait()
                if self._closing:
                    break
                new, self._inbox = self._inbox, []
            try:
                for seq in new:
                    self._admit(seq)
                self._reap()
                if self._active:
                    self._step()
            except Exception as e:  # logged once; every sequence in flight gets the error
                log.exception("%s: decoding step failed", self.name)
                for seq in list(self._active):
                    self._finish(seq, "error", BackendError(f"llama.cpp failed: {e}"))
        with self._cv:
            left, self._inbox = self._inbox + self._active, []
        for seq in left:
            self._finish(seq, "cancelled", BackendError("the model is being unloaded"))

    def _admit(self, seq: Sequence) -> None:
        if not self._free_ids:  # the scheduler runs at most ``slots`` at once: never reached
            self._finish(seq, "error", BackendError("no free sequence in the context"), kept=False)
            return
        seq.seq_id = self._free_ids.pop()
        prefix, n = self.prefixes.match(seq.prompt)
        if prefix is not None:
            llama_cpp.llama_memory_seq_cp(self.memory, prefix.seq_id, seq.seq_id, 0, n)
            self._maybe_save(prefix)
        seq.pos = n
        seq.history = seq.prompt[:n]
        seq.pending = seq.prompt[n:]
        seq.job.cached_tokens = n
        self._active.append(seq)

    def _reap(self) -> None:
        now = time.monotonic()
        for seq in list(self._active):
            job = seq.job
            if job.cancelled.is_set():
                self._finish(seq, "cancelled")
            elif now > job.deadline:
                err = DeadlineExceededError(f"generation passed its deadline after {job.completion_tokens} tokens")
                self._finish(seq, "error", err)

    def _put(self, i: int, token: int, pos: int, seq_id: int, logits: bool) -> None:
        self._tok[i] = token
        self._pos[i] = pos
        self._seq_cell[i][0] = seq_id
        self._out[i] = logits

    def _step(self) -> None:
        n = 0
        outputs: list[tuple[Sequence, int]] = []
        for seq in self._active:
            if seq.next_token >= 0:
                self._put(n, seq.next_token, seq.pos, seq.seq_id, True)
                outputs.append((seq, n))
                seq.history.append(seq.next_token)
                seq.pos += 1
                seq.next_token = -1
                n += 1
        room = self.llm.prefill_chunk
        for seq in self._active:
            if room <= 0:
                break
            if not seq.pending:
                continue
            take = seq.pending[:room]
            del seq.pending[: len(take)]
            for i, token in enumerate(take):
                self._put(n + i, token, seq.pos + i, seq.seq_id, False)
            n += len(take)
            seq.history.extend(take)
            seq.pos += len(take)
            room -= len(take)
            if not seq.pending:
                self._out[n - 1] = True
                outputs.append((seq, n - 1))
        self._batch.n_tokens = n
        rc = llama_cpp.llama_decode(self.ctx, self._batch)
        self.steps += 1
        if rc != 0:
            why = "the KV cache is full" if rc == 1 else f"llama_decode returned {rc}"
            ids = {int(self._seq_cell[i][0]) for i in range(n)}
            for seq in [s for s in self._active if s.seq_id in ids]:
                self._finish(seq, "error", BackendError(why), kept=False)
            return
        for seq, idx in outputs:
            self._sample(seq, idx)

    def _sample(self, seq: Sequence, idx: int) -> None:
        job = seq.job
        token = int(llama_cpp.llama_sampler_sample(seq.sampler, self.ctx, idx))
        if job.first_token_s is None:
            job.first_token_s = time.monotonic() - seq.started
        if job.sampling.logprobs >= 0:
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, idx), shape=(self.n_vocab,))
            job.token_logprobs.append(logprob_entry(logits, token, job.sampling.logprobs, self._piece))
        if llama_cpp.llama_vocab_is_eog(self.vocab, token):
            self._finish(seq, "stop")
            return
        job.completion_tokens += 1
        if seq.text.feed(self._piece(token)):
            self._finish(seq, "stop")
        elif job.completion_tokens >= job.sampling.max_tokens:
            self._finish(seq, "length")
        else:
            seq.next_token = token

    def _piece(self, token: int) -> bytes:
        n = llama_cpp.llama_token_to_piece(self.vocab, token, self._piece_buf, len(self._piece_buf), 0, False)
        if n < 0:  # a piece longer than the buffer: -n is its length
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, -n, 0, False)
            return buf.raw[:n]
        return self._piece_buf.raw[:n]

    def _finish(self, seq: Sequence, reason: str, error: EdgedError | None = None, kept: bool = True) -> None:
        job = seq.job
        if seq.seq_id >= 0:
            if kept and error is None:
                self._keep(seq)
            llama_cpp.llama_memory_seq_rm(self.memory, seq.seq_id, -1, -1)
            self._free_ids.append(seq.seq_id)
            seq.seq_id = -1
        if seq in self._active:
            self._active.remove(seq)
        if seq.sampler is not None:
            llama_cpp.llama_sampler_free(seq.sampler)
            seq.sampler = None
        job.finish_reason = reason
        job.text = seq.text.finish()
        if error is not None:
            job.error = error
        if reason == "cancelled":
            log.info("%s: generation cancelled after %d tokens", self.name, job.completion_tokens)
        seq.done.set()

    # --- kept prefixes ---

    def _keep(self, seq: Sequence) -> None:
        """Keep the finished sequence's cells (the chat so far) for a request that continues it."""
        placed = self.prefixes.place(seq.history[: seq.pos])
        if placed is None:
            return
        seq_id, dropped = placed
        for p in dropped:
            llama_cpp.llama_memory_seq_rm(self.memory, p.seq_id, -1, -1)
        llama_cpp.llama_memory_seq_cp(self.memory, seq.seq_id, seq_id, 0, seq.pos)

    def _prime(self) -> None:
        restored = self._restore() if self._states is not None else 0
        system = self._system
        if system and len(system) >= 2 and self.prefixes.find(system) is None:
            started = time.monotonic()
            placed = self.prefixes.place(system, pinned=True)
            if placed is None:
                log.warning(
                    "%s: the system prompt (%d tokens) does not fit prefix_cache_tokens", self.name, len(system)
                )
                return
            seq_id, _ = placed
            self._prefill(seq_id, system)
            prefix = self.prefixes.entries[seq_id]
            log.info(
                "%s: system prompt prefilled (%d tokens, %.0f ms)",
                self.name,
                len(system),
                (time.monotonic() - started) * 1000,
            )
            self._save(prefix)
        elif system and (p := self.prefixes.find(system)) is not None:
            p.pinned = True
        self.restored = restored
        if restored:
            log.info("%s: %d saved prefixes restored and verified", self.name, restored)

    def _prefill(self, seq_id: int, tokens: list[int]) -> None:
        for start in range(0, len(tokens), self.capacity):
            part = tokens[start : start + self.capacity]
            for i, token in enumerate(part):
                self._put(i, token, start + i, seq_id, False)
            self._batch.n_tokens = len(part)
            rc = llama_cpp.llama_decode(self.ctx, self._batch)
            if rc != 0:
                llama_cpp.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
                raise BackendError(f"prefilling a prefix: llama_decode returned {rc}")

    def _recompute(self, prefix: Prefix) -> np.ndarray:
        """The next-token logits of a one-token recompute on top of the prefix's cells: the last
        token decoded again on a scratch sequence that shares all the cells before it."""
        scratch = self._free_ids[-1]
        last = len(prefix.tokens) - 1
        llama_cpp.llama_memory_seq_cp(self.memory, prefix.seq_id, scratch, 0, last)
        try:
            self._put(0, prefix.tokens[last], last, scratch, True)
            self._batch.n_tokens = 1
            rc = llama_cpp.llama_decode(self.ctx, self._batch)
            if rc != 0:
                raise BackendError(f"checking a prefix: llama_decode returned {rc}")
            ptr = llama_cpp.llama_get_logits_ith(self.ctx, 0)
            return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()
        finally:
            llama_cpp.llama_memory_seq_rm(self.memory, scratch, -1, -1)

    def _path(self, prefix: Prefix) -> Path:
        assert self._states is not None
        return self._states / f"{prefix.digest[:32]}.kv"

    def _maybe_save(self, prefix: Prefix) -> None:
        """A prefix that a second request has reused is worth keeping across restarts."""
        if prefix.hits >= 2 and not prefix.saved and self._free_ids:
            self._save(prefix)

    def _save(self, prefix: Prefix) -> None:
        if self._states is None or prefix.saved or not self._free_ids:
            return
        saved = sum(1 for p in self.prefixes.entries.values() if p.saved)
        if saved >= self.llm.saved_prefixes:
            return
        prefix.saved = True
        started = time.monotonic()
        logits = self._recompute(prefix)
        top = [(int(t), float(logits[t])) for t in np.argsort(-logits)[:CHECK_LOGITS]]
        size = llama_cpp.llama_state_seq_get_size(self.ctx, prefix.seq_id)
        buf = (ctypes.c_uint8 * size)()
        got = llama_cpp.llama_state_seq_get_data(self.ctx, buf, size, prefix.seq_id)
        state = statefile.SavedState(prefix.tokens, bytes(memoryview(buf)[:got]), tuple(top))
        path, keep = self._path(prefix), {self._path(p) for p in self.prefixes.entries.values() if p.saved}
        log.info(
            "%s: saving a prefix of %d tokens (%d KiB, %.0f ms to copy)",
            self.name,
            len(prefix.tokens),
            got >> 10,
            (time.monotonic() - started) * 1000,
        )
        self._writer.submit(self._write, path, state, keep)

    def _write(self, path: Path, state: statefile.SavedState, keep: set[Path]) -> None:
        try:
            statefile.write(path, self._binding, state)
            for old in statefile.saved_files(path.parent)[self.llm.saved_prefixes :]:
                if old not in keep and old != path:
                    old.unlink(missing_ok=True)
        except OSError as e:
            log.warning("%s: cannot save a prefix state to %s: %s", self.name, path, e)

    def _restore(self) -> int:
        """Restore and check every saved prefix. A state that fails its check may have left
        non-finite values in cells that attention still reads (masked weights are zeros, and
        zero times NaN is NaN), so after a failure the cache is wiped, values included, and the
        states that passed are restored again; the failed one is in the quarantine by then."""
        for _ in range(self.llm.saved_prefixes + 1):
            restored, failed = self._restore_all()
            if not failed:
                return restored
            llama_cpp.llama_memory_clear(self.memory, True)
            self.prefixes = PrefixTable(self.prefixes.ids, self.llm.prefix_cache_tokens)
        return 0

    def _restore_all(self) -> tuple[int, bool]:
        assert self._states is not None
        restored = 0
        limit = self.llm.prefix_cache_tokens << 20  # a MiB a token: far above any model's KV
        for path in statefile.saved_files(self._states)[: self.llm.saved_prefixes]:
            started = time.monotonic()
            try:
                saved = statefile.read(path, self._binding, limit)
            except statefile.StateFileError as e:
                statefile.quarantine(path, str(e))
                continue
            placed = self.prefixes.place(saved.tokens, pinned=list(saved.tokens) == self._system)
            if placed is None:
                continue
            prefix = self.prefixes.entries[placed[0]]
            why = self._load_state(prefix, saved)
            if why:
                statefile.quarantine(path, why)
                log.warning("%s: a saved prefix failed its check (%s); it is prefilled again", self.name, why)
                return 0, True
            prefix.saved = True
            restored += 1
            log.info(
                "%s: restored a prefix of %d tokens in %.0f ms (%s)",
                self.name,
                len(saved.tokens),
                (time.monotonic() - started) * 1000,
                token_digest(saved.tokens)[:12],
            )
        return restored, False

    def _load_state(self, prefix: Prefix, saved: statefile.SavedState) -> str:
        """'' when the state restored into ``prefix`` is the one saved, else why not."""
        buf = (ctypes.c_uint8 * len(saved.state)).from_buffer_copy(saved.state)
        if llama_cpp.llama_state_seq_set_data(self.ctx, buf, len(saved.state), prefix.seq_id) == 0:
            return "llama.cpp refused the state"
        lo = llama_cpp.llama_memory_seq_pos_min(self.memory, prefix.seq_id)
        hi = llama_cpp.llama_memory_seq_pos_max(self.memory, prefix.seq_id)
        if (lo, hi) != (0, len(saved.tokens) - 1):
            return f"restored positions {lo}..{hi}, the prefix has {len(saved.tokens)} tokens"
        got = self._recompute(prefix)
        for token, want in saved.logits:
            have = float(got[token]) if 0 <= token < self.n_vocab else float("nan")
            if not abs(have - want) <= CHECK_TOLERANCE:
                return f"next-token logits differ from the saved ones (token {token}: {have:.4f} vs {want:.4f})"
        return ""
