"""Language models in GGUF files, run by llama.cpp through llama-cpp-python (this package is the
only one that imports ``llama_cpp``).

Why llama.cpp: it is what Jetson users already run (alone, or inside Ollama), it builds for the
Jetson's CUDA (``CMAKE_ARGS="-DGGML_CUDA=on"``) and for plain CPUs from the same source, and it
reads the quantised GGUF files that small boards need. A model's slots are sequences of one
context that decodes them together (engine.py); each slot here is the worker thread that prepares
a request and waits for its sequence to end.

The cache entry of a GGUF model is a small descriptor (the file's digest is in the key, its
dimensions in the descriptor), not a copy: a model of several GB is never duplicated on disk.
Kept prefix states are saved beside it (statefile.py).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import random
import threading
from collections.abc import Mapping
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Any, cast

import llama_cpp
import numpy as np
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from edged.backends.base import Backend, BuildSpec, Instance, LoadOptions, Progress, TensorSpec
from edged.backends.llama import statefile
from edged.backends.llama.engine import BatchEngine
from edged.backends.llama.gguf import GgufInfo, footprint_of, gguf_info
from edged.backends.llama.prefixes import common_length
from edged.backends.llama.sequence import Sequence, grammar_of, grammar_sampler, sampler_chain
from edged.config import LlmConfig, ModelConfig
from edged.errors import BackendError, BuildError, DeadlineExceededError, InvalidInputError
from edged.llm.generation import INPUT, OUTPUT, GenerationJob, Sampling, llm_config
from edged.llm.gguf_header import read_header

log = logging.getLogger(__name__)
_native = logging.getLogger("edged.llama.cpp")


@llama_cpp.llama_log_callback
def _route_log(level: int, text: bytes, _user: Any) -> None:
    """llama.cpp's own lines into logging (the daemon never prints): ggml's levels are
    1 debug, 2 info, 3 warn, 4 error, 5 a continuation."""
    line = text.decode("utf-8", errors="replace").rstrip()
    if not line:
        return
    if level == 4:
        _native.error("%s", line)
    elif level == 3:
        _native.info("%s", line)
    else:
        _native.debug("%s", line)


llama_cpp.llama_log_set(_route_log, None)

CLOSE_WAIT_S = 30  # unloading waits this long for the decoding thread's current step
WARM_TEXT = (
    "Sensors on the line report temperature, vibration and current every second. Summarise the last "
    "hour for the operator, flag anything unusual, and suggest what to check first. "
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


class LlamaBackend(Backend):
    name = "llama"
    artifact_suffix = ".llm.json"
    precisions = ("fp32",)

    def __init__(self, artifact: Path, options: LoadOptions | None = None) -> None:
        super().__init__(artifact, options)
        self.llm: LlmConfig = (options.options.get("llm") if options else None) or LlmConfig()
        self.source = ""
        self.info: GgufInfo | None = None
        self._formatter: Jinja2ChatFormatter | None = None
        self.engine: BatchEngine | None = None
        self._engine_lock = threading.Lock()
        self.tokenize: Any = None
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
        """The plan's figure: weights, the KV cache of every slot and kept prefix, compute buffers."""
        return footprint_of(gguf_info(model.path), llm_config(model))

    # --- loading ---

    def _load_impl(self) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
        desc = json.loads(self.artifact.read_text())
        self.source = str(desc["gguf"])
        self.info = gguf_info(self.source)
        spec = (TensorSpec(INPUT, "object", (1,)),), (TensorSpec(OUTPUT, "object", (1,)),)
        return spec

    def _threads(self) -> int:
        """One context decodes every slot: it gets every core the daemon may use."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return self.options.threads or cores

    def _instance_impl(self, threads: int) -> Instance:
        with self._engine_lock:
            if self.engine is None:
                self.engine = self._start_engine()
        return LlamaSlot(self, self.engine)

    def _start_engine(self) -> BatchEngine:
        llm = LlmConfig(**{**_fields(self.llm), "slots": max(1, self.options.instances)})
        name = Path(self.source).name
        try:
            engine = BatchEngine(name, self.source, llm, self._threads(), _gpu())
        except Exception as e:
            raise BackendError(f"llama.cpp cannot load {self.source}: {e}") from e
        self._formatter = _formatter(engine)
        self.tokenize = engine.model.tokenize
        binding = {
            "entry": self.artifact.name,
            "llama_cpp": llama_cpp.__version__,
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace"),
        }
        states = statefile.directory(self.artifact) if self.llm.saved_prefixes > 0 else None
        engine.start(states, binding, self.system_tokens())
        return engine

    def _unload_impl(self) -> None:
        self.closing = True  # a generation still running stops before its next token
        engine, self.engine = self.engine, None
        if engine is not None and not engine.close(CLOSE_WAIT_S):
            # a native call that does not return: leak the context rather than free it under the thread
            log.error("%s: decoding did not stop within %d s; its context is not freed", self.source, CLOSE_WAIT_S)

    def _footprint_impl(self) -> int:
        assert self.info is not None
        return footprint_of(self.info, LlmConfig(**{**_fields(self.llm), "slots": max(1, self.options.instances)}))

    def with_system(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        """The model's default system message first, when the request sends none."""
        if self.llm.system_prompt and not any(m["role"] == "system" for m in messages):
            return [{"role": "system", "content": self.llm.system_prompt}, *messages]
        return messages

    def render(self, messages: list[dict[str, str]]) -> str:
        if self._formatter is None:
            raise InvalidInputError(f"{Path(self.source).name} has no chat template; use completions")
        try:
            return str(self._formatter(messages=cast(Any, self.with_system(messages))).prompt)
        except Exception as e:  # the template's own raise_exception (e.g. roles out of order)
            raise InvalidInputError(f"the model's chat template rejects these messages: {e}") from e

    def system_tokens(self) -> list[int]:
        """The tokens every chat with the default system message starts with: the common start
        of two such chats, whatever the template puts around the messages."""
        if not self.llm.system_prompt or self._formatter is None:
            return []
        a, b = (self._tokens(self.render([{"role": "user", "content": t}])) for t in ("a", "b"))
        return a[: common_length(a, b)]

    def _tokens(self, text: str) -> list[int]:
        return list(self.tokenize(text.encode("utf-8"), True, True))

    def warmup_job(self, engine: BatchEngine) -> GenerationJob:
        """A chat request at the sizes requests use: the template, a few hundred prompt tokens,
        some decode steps. Every slot is a sequence of the one context, so once a warm-up has
        run at those sizes the others only check that their slot answers (one token, on the
        prompt the first one left in the prefix cache)."""
        words = WARM_TEXT.split()
        text = " ".join(words[i % len(words)] for i in range(int(self.llm.warmup_prompt_tokens * 0.75)))
        tokens = 1 if engine.warmed.is_set() else self.llm.warmup_decode_tokens
        engine.warmed.set()
        return GenerationJob(
            messages=[{"role": "user", "content": text}] if self._formatter else None,
            prompt=text,
            sampling=Sampling(tokens, self.llm.temperature, self.llm.top_p, seed=0),
            context=self.llm.context,
            warmup=True,
        )


def _fields(llm: LlmConfig) -> dict[str, Any]:
    return {f: getattr(llm, f) for f in llm.__struct_fields__}


def _gpu() -> bool:
    return bool(llama_cpp.llama_supports_gpu_offload())


def _formatter(engine: BatchEngine) -> Jinja2ChatFormatter | None:
    model = engine.model
    template = model.metadata().get("tokenizer.chat_template")
    if not template:
        return None
    eos, bos = model.token_eos(), model.token_bos()
    return Jinja2ChatFormatter(
        template=template,
        eos_token=model.token_get_text(eos) if eos != -1 else "",
        bos_token=model.token_get_text(bos) if bos != -1 else "",
    )


class LlamaSlot(Instance):
    """One slot: prepares a request on its worker thread and runs it as a sequence of the
    model's batched context."""

    def __init__(self, backend: LlamaBackend, engine: BatchEngine) -> None:
        super().__init__(backend, engine.context.params.n_threads)
        self.owner = backend
        self.engine = engine

    def _infer_impl(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        item = inputs[INPUT].reshape(-1)[0]
        # The registry's warm-up passes placeholder tensors: answer them with a generation at
        # request sizes, which is what warm means for a language model.
        job = item if isinstance(item, GenerationJob) else self.owner.warmup_job(self.engine)
        try:
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
        tokens = self.owner._tokens(text)
        room = job.context - len(tokens)
        if room < 1:
            raise InvalidInputError(f"the prompt is {len(tokens)} tokens; the context holds {job.context}")
        s = job.sampling
        if s.max_tokens > room:
            if s.max_tokens_explicit:
                raise InvalidInputError(
                    f"prompt ({len(tokens)} tokens) + max_tokens ({s.max_tokens}) exceeds the context ({job.context})"
                )
            job.sampling = replace(s, max_tokens=room)
        job.prompt_tokens = len(tokens)
        return tokens

    def _run(self, job: GenerationJob) -> None:
        if job.cancelled.is_set():  # its client left while it waited for this slot
            job.finish_reason = "cancelled"
            log.info("%s: generation cancelled after 0 tokens", Path(self.owner.source).name)
            return
        tokens = self._prompt_tokens(job)
        s = job.sampling
        grammar = grammar_of(s.response_format)
        seed = s.seed if s.seed is not None else random.randrange(2**32)
        constrain = grammar_sampler(self.engine.vocab, grammar)
        try:
            chain = sampler_chain(s, seed, self.engine.n_vocab, job.context)
        except BaseException:
            if constrain is not None:
                llama_cpp.llama_sampler_free(constrain)
            raise
        seq = Sequence(job, tokens, chain, constrain)
        self.engine.run(seq, lambda: self.owner.closing)
