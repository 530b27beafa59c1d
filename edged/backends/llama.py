"""Language models in GGUF files, run by llama.cpp through llama-cpp-python; the only module that
imports ``llama_cpp``.

Why llama.cpp: it is what Jetson users already run (alone, or inside Ollama), it builds for the
Jetson's CUDA (``CMAKE_ARGS="-DGGML_CUDA=on"``) and for plain CPUs from the same source, it reads
the quantised GGUF files that small boards need, and its Python binding gives a token-level loop
we can stop between any two tokens. Each slot is one llama.cpp context (its own KV cache of
``context`` tokens) on the same memory-mapped weights, so slots share the weights' pages.

The cache entry of a GGUF model is a small descriptor (the file's digest is in the key, its
dimensions in the descriptor), not a copy: a model of several GB is never duplicated on disk.
"""

from __future__ import annotations

import codecs
import json
import logging
import os
import platform
import random
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, cast

import llama_cpp
import numpy as np
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from edged.backends.base import Backend, BuildSpec, Instance, LoadOptions, Progress, TensorSpec
from edged.config import LlmConfig, ModelConfig
from edged.errors import BackendError, BuildError, DeadlineExceededError, InvalidInputError
from edged.llm.generation import INPUT, OUTPUT, GenerationJob, Sampling, StopMatcher, llm_config
from edged.llm.gguf_header import read_header

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 30  # unloading waits this long for a slot's current token
# Prompt tokens evaluated per llama.cpp batch: the prefill's step, and what its compute buffer is sized for.
BATCH = 256
WARM_TEXT = (
    "Sensors on the line report temperature, vibration and current every second. Summarise the last "
    "hour for the operator, flag anything unusual, and suggest what to check first. "
)


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

    def kv_bytes(self, context: int) -> int:
        """Bytes of one slot's KV cache (f16 keys and values for every layer)."""
        return self.n_layer * context * 2 * self.n_head_kv * self.head_dim * 2

    def compute_bytes(self, context: int) -> int:
        """llama.cpp's compute buffer for one slot: attention scores of a full batch against
        the whole context dominate it (no flash attention on the CPU path)."""
        ubatch = min(BATCH, context)
        return ubatch * context * self.n_head * 4 + ubatch * self.n_embd * 4 * 16 + self.n_vocab * 4 * 2

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


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


@lru_cache(maxsize=1)
def _file_types() -> dict[int, str]:
    """llama.cpp's file types by number, named as llama.cpp names them (``LLAMA_FTYPE_MOSTLY_Q4_1``
    is ``q4_1``)."""
    out: dict[int, str] = {}
    for name in dir(llama_cpp):
        if name.startswith("LLAMA_FTYPE_") and isinstance(getattr(llama_cpp, name), int):
            short = name.removeprefix("LLAMA_FTYPE_").removeprefix("MOSTLY_").removeprefix("ALL_")
            out.setdefault(int(getattr(llama_cpp, name)), short.lower())
    return out


def gguf_info(path: str) -> GgufInfo:
    st = os.stat(path)
    return _read_info(path, st.st_mtime_ns, st.st_size)


def footprint_of(info: GgufInfo, llm: LlmConfig) -> int:
    """Weights once, plus each slot's KV cache and compute buffer."""
    return info.size + llm.slots * (info.kv_bytes(llm.context) + info.compute_bytes(llm.context))


class LlamaBackend(Backend):
    name = "llama"
    artifact_suffix = ".llm.json"
    precisions = ("fp32",)

    def __init__(self, artifact: Path, options: LoadOptions | None = None) -> None:
        super().__init__(artifact, options)
        self.llm: LlmConfig = (options.options.get("llm") if options else None) or LlmConfig()
        self.source = ""
        self.info: GgufInfo | None = None
        self._slots: list[LlamaSlot] = []
        self._formatter: Jinja2ChatFormatter | None = None
        self.closing = False

    @classmethod
    def available(cls) -> tuple[bool, str]:
        return True, f"llama-cpp-python {llama_cpp.__version__}, {'GPU offload' if _gpu() else 'CPU'}"

    @classmethod
    def version(cls) -> str:
        return str(llama_cpp.__version__)

    @classmethod
    def fingerprint(cls) -> dict[str, str]:
        return {"arch": platform.machine(), "gpu_offload": str(_gpu())}

    @classmethod
    def effective_precision(cls, wanted: str) -> tuple[str, str]:
        if wanted == "fp32":
            return "fp32", ""
        return "fp32", f"llama runs the GGUF's own quantisation; precision {wanted} does not apply"

    @classmethod
    def build(cls, spec: BuildSpec, dest: Path, progress: Progress) -> dict[str, Any]:
        """The entry is a descriptor: the GGUF's path and dimensions (checked readable here)."""
        progress("reading GGUF header", None)
        info = gguf_info(spec.source)
        if info.n_layer <= 0 or info.n_embd <= 0:
            raise BuildError(f"{spec.source}: GGUF without a language model's dimensions ({info.arch})")
        dest.write_text(json.dumps({"gguf": os.path.abspath(spec.source), "info": info.to_dict()}))
        return {"gguf": info.to_dict()}

    @classmethod
    def stored_precision(cls, path: str) -> str:
        """The GGUF's file type (``general.file_type``): ``q4_1``, ``q8_0``, ``f16``..."""
        try:
            kind = read_header(path).get("general.file_type")
        except BuildError:
            return ""
        if not isinstance(kind, int):
            return ""
        return _file_types().get(kind, f"file type {kind}")

    @classmethod
    def estimate_footprint(cls, model: ModelConfig, manifest: Mapping[str, Any] | None) -> int:
        """The plan's figure: weights + KV cache for context x slots + compute buffers."""
        return footprint_of(gguf_info(model.path), llm_config(model))

    # --- loading ---

    def _load_impl(self) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
        desc = json.loads(self.artifact.read_text())
        self.source = str(desc["gguf"])
        self.info = gguf_info(self.source)
        spec = (TensorSpec(INPUT, "object", (1,)),), (TensorSpec(OUTPUT, "object", (1,)),)
        return spec

    def _threads(self) -> int:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return self.options.threads or max(1, cores // max(1, self.options.instances))

    def _instance_impl(self, threads: int) -> Instance:
        # A generator is never measured for fewer threads (auto_threads is 0): the rule's count.
        threads = self._threads()
        try:
            engine = llama_cpp.Llama(
                self.source,
                n_ctx=self.llm.context,
                n_batch=BATCH,
                n_ubatch=BATCH,
                n_threads=threads,
                n_threads_batch=threads,
                n_gpu_layers=-1 if _gpu() else 0,
                verbose=False,
            )
        except Exception as e:
            raise BackendError(f"llama.cpp cannot load {self.source}: {e}") from e
        if self._formatter is None:
            self._formatter = _formatter(engine)
        slot = LlamaSlot(self, engine, threads)
        self._slots.append(slot)
        return slot

    def _unload_impl(self) -> None:
        self.closing = True  # a generation still running stops before its next token
        for slot in self._slots:
            slot.close()
        self._slots.clear()

    def _footprint_impl(self) -> int:
        assert self.info is not None
        return footprint_of(self.info, LlmConfig(context=self.llm.context, slots=max(1, self.options.instances)))

    def render(self, messages: list[dict[str, str]]) -> str:
        if self._formatter is None:
            raise InvalidInputError(f"{Path(self.source).name} has no chat template; use completions")
        try:
            return str(self._formatter(messages=cast(Any, messages)).prompt)
        except Exception as e:  # the template's own raise_exception (e.g. roles out of order)
            raise InvalidInputError(f"the model's chat template rejects these messages: {e}") from e

    def warmup_job(self) -> GenerationJob:
        """A chat request at the sizes requests use: the template, a few hundred prompt tokens,
        some decode steps."""
        words = WARM_TEXT.split()
        text = " ".join(words[i % len(words)] for i in range(int(self.llm.warmup_prompt_tokens * 0.75)))
        return GenerationJob(
            messages=[{"role": "user", "content": text}] if self._formatter else None,
            prompt=text,
            sampling=Sampling(self.llm.warmup_decode_tokens, self.llm.temperature, self.llm.top_p, seed=0),
            context=self.llm.context,
            warmup=True,
        )


def _gpu() -> bool:
    return bool(llama_cpp.llama_supports_gpu_offload())


def _formatter(engine: llama_cpp.Llama) -> Jinja2ChatFormatter | None:
    template = engine.metadata.get("tokenizer.chat_template")
    if not template:
        return None
    model = engine._model  # token texts are only on the model object
    eos, bos = engine.token_eos(), engine.token_bos()
    return Jinja2ChatFormatter(
        template=template,
        eos_token=model.token_get_text(eos) if eos != -1 else "",
        bos_token=model.token_get_text(bos) if bos != -1 else "",
    )


class LlamaSlot(Instance):
    """One sequence at a time: a llama.cpp context and the loop that feeds it token by token."""

    def __init__(self, backend: LlamaBackend, engine: llama_cpp.Llama, threads: int) -> None:
        super().__init__(backend, threads)
        self.owner = backend
        self.engine = engine
        # Held while a generation runs: the context is freed only once no thread is inside it.
        self._busy = threading.Lock()

    def _infer_impl(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        item = inputs[INPUT].reshape(-1)[0]
        # The registry's warm-up passes placeholder tensors: answer them with a generation at
        # request sizes, which is what warm means for a language model.
        job = item if isinstance(item, GenerationJob) else self.owner.warmup_job()
        try:
            with self._busy:
                if self.owner.closing:
                    raise BackendError("the model is being unloaded")
                self._run(job)
        except (InvalidInputError, DeadlineExceededError) as e:
            job.error = e  # the base class would turn any exception into a backend error
        out = np.empty((1,), dtype=object)
        out[0] = job.text
        return {OUTPUT: out}

    def _prompt_tokens(self, job: GenerationJob) -> list[int]:
        text = self.owner.render(job.messages) if job.messages is not None else job.prompt
        tokens: list[int] = self.engine.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        room = job.context - len(tokens)
        if room < 1:
            raise InvalidInputError(f"the prompt is {len(tokens)} tokens; the context holds {job.context}")
        s = job.sampling
        if s.max_tokens > room:
            if s.max_tokens_explicit:
                raise InvalidInputError(
                    f"prompt ({len(tokens)} tokens) + max_tokens ({s.max_tokens}) exceeds the context ({job.context})"
                )
            job.sampling = Sampling(room, s.temperature, s.top_p, s.stop, s.seed)
        job.prompt_tokens = len(tokens)
        return tokens

    def _run(self, job: GenerationJob) -> None:
        if job.cancelled.is_set():  # its client left while it waited for this slot
            job.finish_reason = "cancelled"
            log.info("%s: generation cancelled after 0 tokens", Path(self.owner.source).name)
            return
        started = time.monotonic()
        tokens = self._prompt_tokens(job)
        s = job.sampling
        engine = self.engine
        engine.set_seed(s.seed if s.seed is not None else random.randrange(2**32))
        vocab = engine._model.vocab
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        stops = StopMatcher(s.stop)
        parts: list[str] = []
        stopped = False
        job.finish_reason = "length"
        gen = engine.generate(tokens, top_k=0, top_p=s.top_p, min_p=0.0, temp=s.temperature, repeat_penalty=1.0)
        try:
            for token in gen:
                if job.first_token_s is None:
                    job.first_token_s = time.monotonic() - started
                if llama_cpp.llama_vocab_is_eog(vocab, token):
                    job.finish_reason = "stop"
                    break
                job.completion_tokens += 1
                piece, stopped = stops.feed(decoder.decode(engine.detokenize([token], special=False)))
                self._emit(job, parts, piece)
                if stopped:
                    job.finish_reason = "stop"
                    break
                if job.completion_tokens >= s.max_tokens:
                    break
                if job.cancelled.is_set() or self.owner.closing:
                    job.finish_reason = "cancelled"
                    break
                if time.monotonic() > job.deadline:
                    raise DeadlineExceededError(f"generation passed its deadline after {job.completion_tokens} tokens")
        finally:
            gen.close()
        if job.finish_reason == "cancelled":
            log.info("%s: generation cancelled after %d tokens", Path(self.owner.source).name, job.completion_tokens)
        if not stopped:  # text held back as a possible stop string was not one after all
            self._emit(job, parts, stops.flush() + decoder.decode(b"", final=True))
        job.text = "".join(parts)

    @staticmethod
    def _emit(job: GenerationJob, parts: list[str], piece: str) -> None:
        if not piece:
            return
        parts.append(piece)
        if job.emit is not None:
            job.emit(piece)

    def close(self) -> None:
        if self._busy.acquire(timeout=CLOSE_WAIT_S):
            try:
                self.engine.close()
            finally:
                self._busy.release()
        else:  # a native call that does not return: leak the context rather than free it under the thread
            log.error("%s: a slot did not stop within %d s; its context is not freed", self.owner.source, CLOSE_WAIT_S)
