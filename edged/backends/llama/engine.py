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
cancellation, deadlines and unloading are checked before every step. Kept prefixes are
keeper.py's.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp._internals import LlamaContext, LlamaModel

from edged.backends.llama.gguf import cells_of, step_tokens
from edged.backends.llama.keeper import PrefixKeeper
from edged.backends.llama.sequence import Candidates, Sequence, logprob_entry, penalised
from edged.config import LlmConfig
from edged.errors import BackendError, DeadlineExceededError, EdgedError

log = logging.getLogger(__name__)

PREFIX_IDS = 8  # sequence ids for kept prefixes, beyond the slots'


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
        self.batch = llama_cpp.llama_batch_init(self.capacity, 0, 1)
        self._tok = np.ctypeslib.as_array(self.batch.token, shape=(self.capacity,))
        self._pos = np.ctypeslib.as_array(self.batch.pos, shape=(self.capacity,))
        self._out = np.ctypeslib.as_array(self.batch.logits, shape=(self.capacity,))
        for i in range(self.capacity):
            self.batch.n_seq_id[i] = 1
        self._seq_cell = [self.batch.seq_id[i] for i in range(self.capacity)]
        self.free_ids = list(range(llm.slots - 1, -1, -1))
        self._cv = threading.Condition()
        self._inbox: list[Sequence] = []
        self._active: list[Sequence] = []
        self._closing = False
        self.keeper = PrefixKeeper(self, range(llm.slots, llm.slots + PREFIX_IDS))
        self._thread = threading.Thread(target=self._main, name=f"llm-{name}", daemon=True)
        self._piece_buf = ctypes.create_string_buffer(64)
        self._candidates = Candidates(self.n_vocab)
        self.primed = threading.Event()
        self.warmed = threading.Event()  # a warm-up at request sizes has run
        self.steps = 0

    # --- the worker threads' side ---

    def start(self, states: Path | None, binding: dict[str, Any], system: list[int]) -> None:
        """Serve from now on; first restore the saved prefixes from ``states`` and keep the
        ``system`` prompt prefilled (requests wait in the inbox until that is done)."""
        self.keeper.states, self.keeper.binding, self.keeper.system = states, binding, system
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
        self.keeper.close()
        llama_cpp.llama_batch_free(self.batch)
        self.context.close()
        self.model.close()
        return True

    # --- the engine's thread ---

    def _main(self) -> None:
        try:
            self.keeper.prime()
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
        if not self.free_ids:  # the scheduler runs at most ``slots`` at once: never reached
            self._finish(seq, "error", BackendError("no free sequence in the context"), kept=False)
            return
        seq.seq_id = self.free_ids.pop()
        n = self.keeper.reuse(seq.prompt, seq.seq_id)
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

    def put(self, i: int, token: int, pos: int, seq_id: int, logits: bool) -> None:
        self._tok[i] = token
        self._pos[i] = pos
        self._seq_cell[i][0] = seq_id
        self._out[i] = logits

    def _step(self) -> None:
        n = 0
        outputs: list[tuple[Sequence, int]] = []
        for seq in self._active:
            if seq.next_token >= 0:
                self.put(n, seq.next_token, seq.pos, seq.seq_id, True)
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
                self.put(n + i, token, seq.pos + i, seq.seq_id, False)
            n += len(take)
            seq.history.extend(take)
            seq.pos += len(take)
            room -= len(take)
            if not seq.pending:
                self._out[n - 1] = True
                outputs.append((seq, n - 1))
        self.batch.n_tokens = n
        rc = llama_cpp.llama_decode(self.ctx, self.batch)
        if rc == 1 and self.keeper.drop():  # no room for the step (the cache left intact): make room once
            rc = llama_cpp.llama_decode(self.ctx, self.batch)
        self.steps += 1
        if rc != 0:
            why = "the KV cache is full" if rc == 1 else f"llama_decode returned {rc}"
            ids = {int(self._seq_cell[i][0]) for i in range(n)}
            for seq in [s for s in self._active if s.seq_id in ids]:
                self._finish(seq, "error", BackendError(why), kept=False)
            return
        for seq, idx in outputs:
            self._sample(seq, idx)

    def _draw_free(self, seq: Sequence, idx: int) -> int:
        return int(llama_cpp.llama_sampler_sample(seq.sampler, self.ctx, idx))  # accepts what it draws

    def _draw(self, seq: Sequence, idx: int) -> int:
        """A draw the response format's grammar allows; asked after the draw, and the whole
        vocabulary filtered only when it refuses."""
        if not penalised(seq.job.sampling):
            token = self._draw_free(seq, idx)
            if not self._candidates.allows(seq.grammar, token):
                token = self._candidates.redraw(seq.grammar, seq.sampler, self._logits(idx))
        else:  # a refused draw must not enter the penalties' history: accept only the kept one
            logits = self._logits(idx)
            token = self._candidates.draw(seq.sampler, logits)
            if not self._candidates.allows(seq.grammar, token):
                token = self._candidates.redraw(seq.grammar, seq.sampler, logits)
            llama_cpp.llama_sampler_accept(seq.sampler, token)
        llama_cpp.llama_sampler_accept(seq.grammar, token)
        return token

    def _sample(self, seq: Sequence, idx: int) -> None:
        job = seq.job
        token = self._draw(seq, idx) if seq.grammar is not None else self._draw_free(seq, idx)
        if job.first_token_s is None:
            job.first_token_s = time.monotonic() - seq.started
        if llama_cpp.llama_vocab_is_eog(self.vocab, token):
            self._finish(seq, "stop")
            return
        if job.sampling.logprobs >= 0:  # one entry per completion token: not for the end of text
            job.token_logprobs.append(logprob_entry(self._logits(idx), token, job.sampling.logprobs, self._piece))
        job.completion_tokens += 1
        if seq.text.feed(self._piece(token)):
            self._finish(seq, "stop")
        elif job.completion_tokens >= job.sampling.max_tokens:
            self._finish(seq, "length")
        else:
            seq.next_token = token

    def _logits(self, idx: int) -> np.ndarray:
        """The step's raw logits for batch row ``idx`` (a view: valid until the next step)."""
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, idx), shape=(self.n_vocab,))

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
                self.keeper.keep(seq.seq_id, seq.history[: seq.pos])
            llama_cpp.llama_memory_seq_rm(self.memory, seq.seq_id, -1, -1)
            self.free_ids.append(seq.seq_id)
            seq.seq_id = -1
        if seq in self._active:
            self._active.remove(seq)
        for sampler in (seq.sampler, seq.grammar):
            if sampler is not None:
                llama_cpp.llama_sampler_free(sampler)
        seq.sampler = seq.grammar = None
        job.finish_reason = reason
        job.text = seq.text.finish()
        if error is not None:
            job.error = error
        if reason == "cancelled":
            log.info("%s: generation cancelled after %d tokens", self.name, job.completion_tokens)
        seq.done.set()

    @property
    def restored(self) -> int:
        """Saved prefixes restored and verified at start."""
        return self.keeper.restored
