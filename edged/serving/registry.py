"""Models and their life: resolve a backend, find or build the cache entry, load, warm, serve,
evict, unload.

Every model the config names has one ``ModelRuntime`` (edged/serving/runtime.py) from start to
stop; its ``state`` and ``reason`` are what the status endpoint, ``edged plan`` and MQTT's
retained state topics show.
Blocking work (loading a session, deserialising an engine, warm-up runs) goes to a thread so the
event loop keeps answering health checks while the daemon boots.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Callable, Mapping

import numpy as np

from edged import backends
from edged.backends.base import Backend, Instance, LoadOptions
from edged.cache.store import EngineCache, Entry
from edged.config import Config, ModelConfig, format_size
from edged.errors import BackendError, BudgetError, CacheError, EdgedError, ModelNotReadyError
from edged.host import malloc
from edged.host.memory import rss_bytes
from edged.quantize.figures import describe, precision_text
from edged.quantize.job import job_key, make_job
from edged.quantize.runner import BuildRunner
from edged.repository.plans import is_engine, prebuilt_entry
from edged.serving.admission import choose_evictions
from edged.serving.batchfit import fit_batching, not_batched
from edged.serving.metrics import Metrics
from edged.serving.runtime import ModelRuntime
from edged.serving.scheduler import ModelQueue
from edged.serving.states import ModelState
from edged.serving.threadpick import fit_threads
from edged.serving.warmup import LOOP_CHECK_MAX_US, inline_max_elements, loop_cost_us, warm_cost_us, warm_inputs
from edged.wire.tensors import is_bytes

log = logging.getLogger(__name__)

StateListener = Callable[["ModelRuntime"], None]


class Registry:
    def __init__(
        self,
        cfg: Config,
        cache: EngineCache,
        runner: BuildRunner,
        metrics: Metrics,
        budget: int,
        on_state: StateListener | None = None,
        wrap_instance: Callable[[Instance], Instance] | None = None,
    ) -> None:
        self.cfg = cfg
        self._wrap_instance = wrap_instance  # tests' fault injection (edged/lifecycle/faults.py), else None
        self.cache = cache
        self.digests = cache.digests
        self.runner = runner
        self.metrics = metrics
        self.budget = budget
        self._on_state = on_state
        self.models: dict[str, ModelRuntime] = {n: ModelRuntime(n, m) for n, m in cfg.models.items()}
        # Models whose requests wait (rather than fail) while a swap replaces them (edged/serving/swap.py).
        self.holds: dict[str, asyncio.Event] = {}

    # --- state ---

    def set_state(self, rt: ModelRuntime, state: ModelState, reason: str = "", notify: bool = True) -> None:
        rt.state, rt.reason = state, reason
        if not notify:  # a retired copy of a model that a reload replaced: nobody watches it
            return
        if self.models.get(rt.name) in (rt, None):  # not a replacement warming beside the one serving
            self.metrics.state.labels(rt.name).set(1 if state == ModelState.READY else 0)
        log.info(
            "%s: %s%s", rt.name, state, f" ({reason})" if reason else "", extra={"model": rt.name, "phase": state.value}
        )
        if self._on_state and self.models.get(rt.name) is rt:
            self._on_state(rt)

    def used(self) -> int:
        return sum(rt.footprint for rt in self.models.values() if rt.backend is not None)

    # --- resolving: which backend, which precision, which cache entry ---

    def resolve(self, rt: ModelRuntime, generation_tag: str | None = None) -> None:
        """Pick the backend and precision, compute the cache key, and read the entry if it is
        already built (its manifest carries the measured footprint). Blocking: a thread's job.
        A model whose backend's library is not importable yet, but may be installed later
        (edged.backends.LATE_LIBRARIES), is left with ``waits_for`` set and the reason in
        ``backend_reason``: the caller makes it ``waiting`` (edged/serving/waiting.py)."""
        if self._waits(rt):
            return
        cls, why = backends.resolve(rt.cfg.backend, rt.cfg.path)
        rt.backend_cls, rt.backend_reason = cls, why
        log.info("%s: backend %s (%s)", rt.name, cls.name, why, extra={"model": rt.name})
        rt.precision, rt.precision_reason = cls.effective_precision(rt.cfg.precision)
        rt.stored_precision = cls.stored_precision(rt.cfg.path)
        if rt.precision_reason:
            log.warning("%s: %s", rt.name, rt.precision_reason, extra={"model": rt.name})
        if not os.path.exists(rt.cfg.path):
            raise EdgedError(f"model file {rt.cfg.path} does not exist")
        rt.job = make_job(
            rt.name,
            rt.cfg,
            cls,
            rt.precision,
            str(self.cache.dir),
            self.digests.digest,
            self._calibration_digest,
            self.cfg.cache.generation_tag if generation_tag is None else generation_tag,
        )
        if is_engine(rt.cfg.path, cls):
            # A TensorRT plan built elsewhere (a model repository's model.plan) is served as it
            # is when its manifest matches this device, and never built or rewritten.
            rt.entry = prebuilt_entry(rt.cfg.path, cls, self.digests.digest)
            rt.precision = str(rt.entry.manifest.get("precision") or rt.precision)
        else:
            rt.entry = self._lookup(rt)
        self._estimate(rt)

    def _waits(self, rt: ModelRuntime) -> bool:
        """Whether ``rt`` waits for its backend's library (then marked so); its file must exist."""
        waiting = backends.waiting_for(rt.cfg.backend, rt.cfg.path)
        if waiting is None:
            return False
        if not os.path.exists(rt.cfg.path):  # said now, not once the library is in
            raise EdgedError(f"model file {rt.cfg.path} does not exist")
        rt.waits_for, rt.backend_reason = waiting
        log.info("%s: waiting: %s", rt.name, rt.backend_reason, extra={"model": rt.name})
        return True

    def _calibration_digest(self, model: ModelConfig) -> str:
        """The calibration folder's digest; file hashes come from the remembered digests, so a
        warm boot does not re-read every sample."""
        from edged.quantize.calibrate import data_digest  # only int8 models need it

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
            auto = entry.manifest.get("auto") or {}
            if auto.get("choice"):  # precision = "auto": the candidates were timed, one chosen
                rt.auto, rt.precision_reason = auto, f"auto chose {auto['choice']['why']}"
                job = job.at_precision(str(auto["choice"]["precision"]))
                continue
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
        self.set_state(rt, ModelState.BUILDING, f"{rt.precision} with {rt.job.backend}")
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
        secs, what = time.monotonic() - started, precision_text(rt.precision, rt.gate)
        log.info("%s: built %s in %.1f s; gate %s", rt.name, what, secs, describe(rt.gate), extra={"model": rt.name})
        self._estimate(rt)

    # --- loading ---

    async def load(self, rt: ModelRuntime, loop: asyncio.AbstractEventLoop) -> None:
        """Load, create instances, warm, start serving. Raises on failure (state is set); a
        failed load holds nothing: no backend, no queue, no share of the budget."""
        assert rt.entry is not None and rt.backend_cls is not None
        self.set_state(rt, ModelState.LOADING)
        try:
            backend, instances, delta = await asyncio.to_thread(self._load_blocking, rt)
        except CacheError as e:
            await self._set_aside(rt, e)
            raise
        rt.backend = backend
        try:
            await self._measure_and_warm(rt, instances, delta, loop)
        except BaseException as e:
            rt.backend, rt.queue = None, None
            await asyncio.shield(asyncio.to_thread(backend.unload))
            if isinstance(e, EdgedError) or not isinstance(e, Exception):
                raise
            raise BackendError(f"{rt.name}: warm-up failed: {e.__class__.__name__}: {e}") from e

    async def _set_aside(self, rt: ModelRuntime, e: CacheError) -> None:
        """The artefact checked out by its stamp but will not load: read it in full to say whether
        it is corrupt or merely not loadable here (another TensorRT); either way move it aside so
        the next start rebuilds it."""
        entry = rt.entry
        rt.entry = None
        if entry is None or rt.stands_in_for or not entry.key:  # not the cache's own: never moved
            return
        problem = await asyncio.to_thread(self.cache.verify, entry)
        why = f"{e.message}; {problem}" if problem else e.message
        await asyncio.to_thread(self.cache.quarantine, entry.artifact, why)
        await asyncio.to_thread(self.cache.quarantine, entry.manifest_path, why)

    async def _measure_and_warm(
        self, rt: ModelRuntime, instances: list[Instance], delta: int, loop: asyncio.AbstractEventLoop
    ) -> None:
        assert rt.backend is not None and rt.entry is not None
        backend = rt.backend
        rt.footprint = backend.footprint() or max(delta, 1)
        rt.measured = True
        self.metrics.footprint.labels(rt.name).set(rt.footprint)
        stored = rt.entry.manifest.get("footprint") or 0
        if not rt.stands_in_for and rt.entry.key and abs(rt.footprint - stored) > 0.25 * max(stored, 1):
            # Remembered for the next boot's plan; small drifts do not rewrite the cache.
            rt.entry = await asyncio.to_thread(self._remember_footprint, rt.entry, rt.footprint)
        self.set_state(rt, ModelState.WARMING)
        room = self._trial_room(rt)
        rt.infer_us, inputs = await asyncio.to_thread(self._warm_blocking, rt, instances, room)
        rt.threads = instances[0].threads if instances else 0
        threshold = self.cfg.server.inline_threshold_us
        if _may_run_inline(rt) and rt.infer_us is not None and 0 < threshold <= rt.infer_us < LOOP_CHECK_MAX_US:
            rt.infer_us = min(rt.infer_us, await loop_cost_us(functools.partial(instances[0].infer, inputs)))
        inline = _may_run_inline(rt) and rt.infer_us is not None and rt.infer_us < threshold
        # A BYTES tensor never runs on the loop (edged/serving/scheduler.py, elements_of): such
        # a model's requests all queue for its worker, where they may batch.
        on_loop = inline and not any(is_bytes(s.np_dtype) for s in backend.inputs)
        rt.batching = not_batched(rt.cfg.max_batch, _batchable(backend), rt.infer_us if on_loop else None)
        if rt.batching is None:  # off the loop: its runs measured against batched ones, on a thread
            run = instances[0].infer
            args = (rt.cfg.max_batch, rt.cfg.preferred_batch, rt.infer_us, rt.name)
            rt.batching = await asyncio.to_thread(fit_batching, run, inputs, *args)
        queue = ModelQueue(
            rt.name,
            instances,
            loop,
            rt.cfg.queue_depth,
            rt.cfg.max_batch,
            rt.cfg.max_queue_delay_us,
            batchable=_batchable(backend),
            preferred=rt.cfg.preferred_batch,
            batch_rows=rt.batching.rows,
        )
        queue.start(inline, inline_max_elements(backend.inputs, rt.cfg, rt.infer_us) if inline and rt.infer_us else 0)
        rt.queue = queue
        rt.last_used = time.monotonic()
        self.set_state(
            rt,
            ModelState.READY,
            f"serving on {rt.serving_on} while building {rt.stands_in_for}" if rt.stands_in_for else "",
        )

    def _remember_footprint(self, entry: Entry, footprint: int) -> Entry:
        try:
            return self.cache.update_manifest(entry, footprint=footprint)
        except OSError as e:  # a hint for the next plan; a full disk must not fail the load
            log.warning("cannot record the footprint in %s: %s", entry.manifest_path.name, e)
            return entry

    def check_loads(self, rt: ModelRuntime) -> None:
        """Load ``rt``'s backend and let it go (blocking; no warm-up, no state, nothing served):
        whether its file serves at all, before a reload commits to it. Raises as ``load`` would."""
        backend, _, _ = self._load_blocking(rt)
        backend.unload()

    def _load_blocking(self, rt: ModelRuntime) -> tuple[Backend, list[Instance], int]:
        assert rt.entry is not None and rt.backend_cls is not None
        before = rss_bytes()
        options = dict(rt.job.options if rt.job and not rt.stands_in_for else {})
        if rt.cfg.llm is not None:  # a language model's context and defaults
            options["llm"] = rt.cfg.llm
        opts = LoadOptions(threads=rt.cfg.threads, instances=rt.cfg.instances, options=options)
        backend = rt.backend_cls(rt.entry.artifact, opts)
        try:
            backend.load()
            instances = [backend.instance() for _ in range(rt.cfg.instances)]
            if self._wrap_instance is not None:
                instances = [self._wrap_instance(inst) for inst in instances]
        except EdgedError:
            backend.unload()
            raise
        except Exception as e:
            backend.unload()
            # A prebuilt plan that does not load is no cache entry to rebuild: the model fails.
            error = CacheError if rt.entry.key or rt.stands_in_for else BackendError
            raise error(f"{rt.name}: {rt.entry.artifact.name} does not load: {e}") from e
        return backend, instances, rss_bytes() - before

    def _warm_blocking(
        self, rt: ModelRuntime, instances: list[Instance], room: bool
    ) -> tuple[float | None, Mapping[str, np.ndarray]]:
        """Run the warm-up inputs through every instance; return one run's cost in us (see
        edged.serving.warmup.warm_cost_us: a low quartile of enough runs, not a noisy median of three),
        None without warm-up runs, and the inputs it ran (the loop check runs them again).
        A cheap model whose thread count the configuration left open is measured with fewer
        threads too, given ``room`` in the budget for trial sessions (edged/serving/threadpick.py): its
        ``instances`` may be replaced in place."""
        assert rt.backend is not None
        if rt.cfg.warmup.iterations == 0:
            return None, {}
        inputs = warm_inputs(rt.backend.inputs, rt.cfg)
        runs = [functools.partial(inst.infer, inputs) for inst in instances]
        threshold = float(self.cfg.server.inline_threshold_us) if _may_run_inline(rt) else None
        cost = warm_cost_us(runs, rt.cfg.warmup.iterations, threshold)
        if room:
            cost = fit_threads(rt.backend, instances, inputs, cost, self._wrap_instance, rt.name)
        return cost, inputs

    def _trial_room(self, rt: ModelRuntime) -> bool:
        """Whether the budget holds two more sessions of this model beside what is loaded (it
        and every other runtime, including one it is about to replace): the most a thread
        trial holds at once besides the instance it measures (edged/serving/threadpick.py)."""
        others = sum(m.footprint for m in self.models.values() if m.backend is not None and m is not rt)
        return others + 3 * rt.footprint <= self.budget

    async def unload(
        self, rt: ModelRuntime, state: ModelState = ModelState.UNLOADED, reason: str = "", notify: bool = True
    ) -> None:
        queue, backend = rt.queue, rt.backend
        rt.queue, rt.backend, rt.batching = None, None, None
        self.set_state(rt, state, reason, notify)
        if queue is not None:
            queue.close()
            await asyncio.to_thread(queue.join, self.cfg.lifecycle.drain_timeout_s)
        if backend is not None:
            await asyncio.to_thread(backend.unload)
            malloc.thaw()  # a backend held in a cycle among the frozen start-up objects: freed now

    def keys_in_use(self) -> set[str]:
        return {rt.entry.key for rt in self.models.values() if rt.entry is not None and rt.entry.key}

    # --- lazy models ---

    async def ensure_loaded(self, rt: ModelRuntime, loop: asyncio.AbstractEventLoop) -> None:
        """Load a lazy (or unloaded) model on demand, evicting least recently used lazy models
        when the budget requires it. Never builds: a missing engine is a 503, not a wait."""
        async with rt.loading:
            if rt.state == ModelState.READY:
                return
            if rt.entry is None:
                raise ModelNotReadyError(f"model '{rt.name}' is {rt.state}: {rt.reason or 'not built'}")
            await self._make_room(rt)
            try:
                await self.load(rt, loop)
            except EdgedError as e:
                self.set_state(rt, ModelState.FAILED, e.message)
                raise ModelNotReadyError(f"model '{rt.name}' failed to load: {e.message}") from e

    async def _make_room(self, rt: ModelRuntime) -> None:
        free = self.budget - self.used()
        candidates = [
            (m.name, m.footprint, m.last_used)
            for m in self.models.values()
            if m.cfg.preload == "lazy" and m.state == ModelState.READY and m is not rt
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
            await self.unload(self.models[name], ModelState.LAZY, f"evicted for {rt.name}")


def _batchable(backend: Backend) -> bool:
    return bool(backend.inputs) and all(s.shape and s.shape[0] < 0 for s in backend.inputs)


def _may_run_inline(rt: ModelRuntime) -> bool:
    """Whether a model cheap enough may run on the event loop: one instance (the loop runs the
    first), and never a generator (a language model streams for seconds)."""
    return rt.cfg.instances == 1 and rt.cfg.llm is None and not rt.cfg.path.lower().endswith(".gguf")
