"""Models and their life: resolve a backend, find or build the cache entry, load, warm, serve,
evict, unload.

Every model the config names has one ``ModelRuntime`` from start to stop; its ``state`` and
``reason`` are what the status endpoint, ``edged plan`` and MQTT's retained state topics show.
Blocking work (loading a session, deserialising an engine, warm-up runs) goes to a thread so the
event loop keeps answering health checks while the daemon boots.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edged import backends
from edged.backends.base import Backend, Instance, LoadOptions, TensorSpec
from edged.build.job import BuildJob, job_key, make_job
from edged.build.runner import BuildRunner
from edged.cache import EngineCache, Entry, SourceDigests
from edged.config import Config, ModelConfig, format_size
from edged.errors import BudgetError, CacheError, EdgedError, ModelNotReadyError
from edged.memory import PlanItem, choose_evictions, rss_bytes
from edged.metrics import Metrics
from edged.scheduler import ModelQueue
from edged.warmup import warm_inputs

log = logging.getLogger(__name__)

# States a model moves through; the strings are part of the status API and MQTT topics.
PENDING, BUILDING, LOADING, WARMING, READY = "pending", "building", "loading", "warming", "ready"
DEFERRED, FAILED, UNLOADED, LAZY = "deferred", "failed", "unloaded", "lazy"

StateListener = Callable[["ModelRuntime"], None]


@dataclass
class ModelRuntime:
    name: str
    cfg: ModelConfig
    state: str = PENDING
    reason: str = ""
    backend_cls: type[Backend] | None = None
    backend_reason: str = ""
    precision: str = ""
    precision_reason: str = ""
    job: BuildJob | None = None
    entry: Entry | None = None
    backend: Backend | None = None
    queue: ModelQueue | None = None
    footprint: int = 0
    measured: bool = False
    infer_us: float | None = None
    last_used: float = field(default_factory=time.monotonic)
    gate: dict[str, Any] | None = None
    loading: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        return self.backend.inputs if self.backend else ()

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return self.backend.outputs if self.backend else ()

    def plan_item(self) -> PlanItem:
        return PlanItem(self.name, self.cfg.priority, self.cfg.preload, self.footprint, self.measured)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "state": self.state,
            "reason": self.reason,
            "backend": self.backend_cls.name if self.backend_cls else None,
            "backend_reason": self.backend_reason,
            "precision": self.precision,
            "requested_precision": self.cfg.precision,
            "precision_reason": self.precision_reason,
            "priority": self.cfg.priority,
            "preload": self.cfg.preload,
            "instances": self.cfg.instances,
            "footprint_bytes": self.footprint,
            "footprint_measured": self.measured,
            "inline": bool(self.queue and self.queue.inline),
            "infer_us": None if self.infer_us is None else round(self.infer_us, 1),
            "queue": self.queue.pending if self.queue else 0,
            **(self.queue.batch_stats() if self.queue else {"batches": 0, "rows": 0}),
            "cache_key": self.entry.key if self.entry else None,
            "gate": self.gate,
        }


class Registry:
    def __init__(
        self,
        cfg: Config,
        cache: EngineCache,
        runner: BuildRunner,
        metrics: Metrics,
        budget: int,
        on_state: StateListener | None = None,
    ) -> None:
        self.cfg = cfg
        self.cache = cache
        self.digests = SourceDigests(cache.dir)
        self.runner = runner
        self.metrics = metrics
        self.budget = budget
        self._on_state = on_state
        self.models: dict[str, ModelRuntime] = {n: ModelRuntime(n, m) for n, m in cfg.models.items()}
        # Models whose requests wait (rather than fail) while a reload swaps them.
        self.holds: dict[str, asyncio.Event] = {}

    # --- state ---

    def set_state(self, rt: ModelRuntime, state: str, reason: str = "", notify: bool = True) -> None:
        rt.state, rt.reason = state, reason
        if not notify:  # a retired copy of a model that a reload replaced: nobody watches it
            return
        self.metrics.state.labels(rt.name).set(1 if state == READY else 0)
        log.info("%s: %s%s", rt.name, state, f" ({reason})" if reason else "", extra={"model": rt.name, "phase": state})
        if self._on_state and self.models.get(rt.name) is rt:
            self._on_state(rt)

    def used(self) -> int:
        return sum(rt.footprint for rt in self.models.values() if rt.backend is not None)

    # --- resolving: which backend, which precision, which cache entry ---

    def resolve(self, rt: ModelRuntime) -> None:
        """Pick the backend and precision, compute the cache key, and read the entry if it is
        already built (its manifest carries the measured footprint)."""
        cls, why = backends.resolve(rt.cfg.backend, rt.cfg.path)
        rt.backend_cls, rt.backend_reason = cls, why
        log.info("%s: backend %s (%s)", rt.name, cls.name, why, extra={"model": rt.name})
        rt.precision, rt.precision_reason = cls.effective_precision(rt.cfg.precision)
        if rt.precision_reason:
            log.warning("%s: %s", rt.name, rt.precision_reason, extra={"model": rt.name})
        if not os.path.exists(rt.cfg.path):
            raise EdgedError(f"model file {rt.cfg.path} does not exist")
        rt.job = make_job(
            rt.name, rt.cfg, cls, rt.precision, str(self.cache.dir), self.digests.digest, self._calibration_digest
        )
        rt.entry = self._lookup(rt)
        self._estimate(rt)

    def _calibration_digest(self, model: ModelConfig) -> str:
        """The calibration folder's digest; file hashes come from the remembered digests, so a
        warm boot does not re-read every sample."""
        from edged.build.calibrate import data_digest  # only int8 models need it

        assert model.calibration is not None
        return data_digest(model.calibration.data, model.calibration, self.digests.digest)

    def _lookup(self, rt: ModelRuntime) -> Entry | None:
        assert rt.job is not None and rt.backend_cls is not None
        cls = rt.backend_cls
        job = rt.job
        # A precision the accuracy gate rejected leaves a record pointing at the fallback.
        for _ in range(3):
            entry = self.cache.lookup(rt.name, job_key(job, cls), cls.artifact_suffix)
            if entry is None or entry.manifest.get("artifact") is not None:
                if entry is not None:
                    rt.precision = job.precision
                    # An fp32 fallback has no gate of its own: keep the rejected one's figures.
                    rt.gate = entry.manifest.get("gate") or rt.gate
                return entry
            fallback = entry.manifest.get("fallback")
            rt.gate = entry.manifest.get("gate")
            rt.precision_reason = entry.manifest.get("reason", "")
            if not fallback:
                return None
            log.warning("%s: %s", rt.name, rt.precision_reason, extra={"model": rt.name})
            job = job.at_precision(fallback)
        return None

    def _estimate(self, rt: ModelRuntime) -> None:
        estimate = getattr(rt.backend_cls, "estimate_footprint", None)
        if estimate is not None:  # a language model: weights + KV cache for context x slots
            rt.footprint, rt.measured = int(estimate(rt.cfg, rt.entry.manifest if rt.entry else None)), False
            return
        if rt.entry is not None and rt.entry.manifest.get("footprint"):
            rt.footprint, rt.measured = int(rt.entry.manifest["footprint"]), True
            return
        size = os.path.getsize(rt.entry.artifact if rt.entry else rt.cfg.path)
        # ONNX Runtime keeps the weights plus an arena about their size per instance.
        rt.footprint, rt.measured = size * (1 + rt.cfg.instances), False

    async def build(self, rt: ModelRuntime, on_progress: Callable[[str, float | None], None]) -> None:
        """Build the entry if the cache has none (in a child process, one build at a time)."""
        if rt.entry is not None:
            return
        assert rt.job is not None
        self.set_state(rt, BUILDING, f"{rt.precision} with {rt.job.backend}")
        started = time.monotonic()
        try:
            await self.runner.build(rt.job, on_progress)
        except EdgedError:
            self.metrics.builds.labels(rt.name, "failed").inc()
            raise
        self.metrics.builds.labels(rt.name, "ok").inc()
        rt.entry = self._lookup(rt)
        if rt.entry is None:
            raise CacheError(f"{rt.name}: the build finished but its cache entry does not check out")
        log.info("%s: built in %.1f s", rt.name, time.monotonic() - started, extra={"model": rt.name})
        self._estimate(rt)

    # --- loading ---

    async def load(self, rt: ModelRuntime, loop: asyncio.AbstractEventLoop) -> None:
        """Load, create instances, warm, start serving. Raises on failure (state is set)."""
        assert rt.entry is not None and rt.backend_cls is not None
        self.set_state(rt, LOADING)
        try:
            backend, instances, delta = await asyncio.to_thread(self._load_blocking, rt)
        except CacheError as e:
            # The artefact checked out but will not load (e.g. a TensorRT version mismatch):
            # move it aside; the next start rebuilds it.
            self.cache.quarantine(rt.entry.artifact, str(e))
            self.cache.quarantine(rt.entry.manifest_path, str(e))
            rt.entry = None
            raise
        rt.backend = backend
        rt.footprint = backend.footprint() or max(delta, 1)
        rt.measured = True
        self.metrics.footprint.labels(rt.name).set(rt.footprint)
        stored = rt.entry.manifest.get("footprint") or 0
        if abs(rt.footprint - stored) > 0.25 * max(stored, 1):
            # Remembered for the next boot's plan; small drifts do not rewrite the cache.
            rt.entry = self.cache.update_manifest(rt.entry, footprint=rt.footprint)
        self.set_state(rt, WARMING)
        rt.infer_us = await asyncio.to_thread(self._warm_blocking, rt, instances)
        inline = rt.infer_us is not None and rt.infer_us < self.cfg.server.inline_threshold_us and rt.cfg.instances == 1
        inline = (
            inline and rt.cfg.llm is None and not rt.cfg.path.lower().endswith(".gguf")
        )  # generation: never on the loop
        queue = ModelQueue(
            rt.name,
            instances,
            loop,
            rt.cfg.queue_depth,
            rt.cfg.max_batch,
            rt.cfg.max_queue_delay_us,
            batchable=_batchable(backend),
        )
        queue.start(inline=inline)
        rt.queue = queue
        rt.last_used = time.monotonic()
        self.set_state(rt, READY)

    def _load_blocking(self, rt: ModelRuntime) -> tuple[Backend, list[Instance], int]:
        assert rt.entry is not None and rt.backend_cls is not None
        before = rss_bytes()
        options = dict(rt.job.options if rt.job else {})
        if rt.cfg.llm is not None:  # a language model's context and defaults
            options["llm"] = rt.cfg.llm
        opts = LoadOptions(threads=rt.cfg.threads, instances=rt.cfg.instances, options=options)
        backend = rt.backend_cls(rt.entry.artifact, opts)
        try:
            backend.load()
            instances = [backend.instance() for _ in range(rt.cfg.instances)]
        except EdgedError:
            backend.unload()
            raise
        except Exception as e:
            backend.unload()
            raise CacheError(f"{rt.name}: {rt.entry.artifact.name} does not load: {e}") from e
        return backend, instances, rss_bytes() - before

    def _warm_blocking(self, rt: ModelRuntime, instances: list[Instance]) -> float | None:
        """Run the warm-up inputs through every instance; return the median run time in us."""
        assert rt.backend is not None
        if rt.cfg.warmup.iterations == 0:
            return None
        inputs = warm_inputs(rt.backend.inputs, rt.cfg)
        times = []
        for inst in instances:
            for _ in range(rt.cfg.warmup.iterations):
                t0 = time.perf_counter()
                inst.infer(inputs)
                times.append((time.perf_counter() - t0) * 1e6)
        return float(np.median(times))

    def hold(self, name: str) -> asyncio.Event:
        gate = self.holds[name] = asyncio.Event()
        return gate

    def release(self, name: str, gate: asyncio.Event) -> None:
        if self.holds.get(name) is gate:
            del self.holds[name]
        gate.set()

    async def unload(self, rt: ModelRuntime, state: str = UNLOADED, reason: str = "", notify: bool = True) -> None:
        queue, backend = rt.queue, rt.backend
        rt.queue, rt.backend = None, None
        self.set_state(rt, state, reason, notify)
        if queue is not None:
            queue.close()
            await asyncio.to_thread(queue.join, self.cfg.lifecycle.drain_timeout_s)
        if backend is not None:
            await asyncio.to_thread(backend.unload)

    # --- lazy models ---

    async def ensure_loaded(self, rt: ModelRuntime, loop: asyncio.AbstractEventLoop) -> None:
        """Load a lazy (or unloaded) model on demand, evicting least recently used lazy models
        when the budget requires it. Never builds: a missing engine is a 503, not a wait."""
        async with rt.loading:
            if rt.state == READY:
                return
            if rt.entry is None:
                raise ModelNotReadyError(f"model '{rt.name}' is {rt.state}: {rt.reason or 'not built'}")
            await self._make_room(rt)
            try:
                await self.load(rt, loop)
            except EdgedError as e:
                self.set_state(rt, FAILED, e.message)
                raise ModelNotReadyError(f"model '{rt.name}' failed to load: {e.message}") from e

    async def _make_room(self, rt: ModelRuntime) -> None:
        free = self.budget - self.used()
        candidates = [
            (m.name, m.footprint, m.last_used)
            for m in self.models.values()
            if m.cfg.preload == "lazy" and m.state == READY and m is not rt
        ]
        victims = choose_evictions(rt.footprint, free, candidates)
        if victims is None:
            raise BudgetError(
                f"model '{rt.name}' needs {format_size(rt.footprint)}, "
                f"{format_size(max(0, free))} of {format_size(self.budget)} is free "
                "even after evicting every idle lazy model"
            )
        for name in victims:
            log.info("evicting %s to load %s", name, rt.name, extra={"model": name})
            await self.unload(self.models[name], LAZY, f"evicted for {rt.name}")


def _batchable(backend: Backend) -> bool:
    return bool(backend.inputs) and all(s.shape and s.shape[0] < 0 for s in backend.inputs)
