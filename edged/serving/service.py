"""The operations both transports call: validate, infer, metadata, status, load and unload.

This is the one place where a request is checked against a model and turned into a scheduler
call, so the socket and MQTT answer the same input with the same result or the same error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from edged import __version__
from edged.config import Config
from edged.errors import (
    EdgedError,
    ModelNotFoundError,
    ModelNotReadyError,
    ShuttingDownError,
    UnavailableError,
)
from edged.host.memory import MemoryInfo, probe
from edged.repository.load_request import PLAIN, LoadRequest
from edged.serving.admission import Plan
from edged.serving.metrics import Metrics, counted
from edged.serving.modelplan import ModelPlan, decode_now, make_plan, outputs_checked, shown
from edged.serving.registry import ModelRuntime, Registry
from edged.serving.scheduler import ModelQueue
from edged.serving.sinks import InputSource, OutputSink
from edged.serving.states import READY, ModelState
from edged.serving.stats import ModelStatistics, Statistics
from edged.serving.versions import Versions, origin_doc
from edged.wire.decode import (
    OFFLOAD_BYTES,
    InferRequest,
    ShmResolver,
    v2_datatype,
)
from edged.wire.jsonchild import decode_infer_async

log = logging.getLogger(__name__)

EXTENSIONS = [
    "binary_tensor_data",
    "model_repository",
    "system_shared_memory",
    "statistics",
    "model_configuration",
    "logging",
    "edged",
]


class ConfiguredLoads(Protocol):
    """Loads that carry a configuration (edged/lifecycle/model_loads.py)."""

    async def load(self, name: str, request: LoadRequest) -> None:
        """Apply the request's config and files, or drop what an earlier load gave."""

    async def unload(self, name: str) -> bool:
        """Release what a load uploaded for ``name``; True when that took the model away."""


class Service:
    def __init__(
        self, registry: Registry, metrics: Metrics, loop: asyncio.AbstractEventLoop, memory: MemoryInfo, plan: Plan
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        self.loop = loop
        self.memory = memory
        self.plan = plan
        self.ready = asyncio.Event()
        self.stopping = False
        self.warming = False
        self.started = time.time()
        self.status_line = "starting"
        # Set by the daemon: '' when every boot model serves (or is degraded on purpose), else why not.
        self.unready: Callable[[], str] = lambda: ""
        # More sections of the status document, set by the daemon's parts (the fleet agent's "fleet").
        self.sections: dict[str, Callable[[], Any]] = {}
        # Applies a load request's config and files (edged/lifecycle/model_loads.py); set once ready.
        self.configured: ConfiguredLoads | None = None
        self._plans: dict[str, ModelPlan] = {}
        self._versions: tuple[Config, Versions] | None = None
        # Triton's statistics extension: one record per configured model (edged/serving/stats.py).
        self.stats = Statistics(lambda: self.registry.models, lambda name: self.versions().served(name))

    # --- health and metadata ---

    def is_ready(self) -> bool:
        return self.ready.is_set() and not self.stopping and not self.unready()

    def server_metadata(self) -> dict[str, Any]:
        return {"name": self.registry.cfg.server.metadata_name, "version": __version__, "extensions": EXTENSIONS}

    def model(self, name: str) -> ModelRuntime:
        rt = self.registry.models.get(name)
        if rt is None:
            raise ModelNotFoundError.named(name)
        return rt

    def versions(self) -> Versions:
        """The served versions of the configuration in force (worked out once per config)."""
        cfg = self.registry.cfg
        if self._versions is None or self._versions[0] is not cfg:
            self._versions = (cfg, Versions.of_config(cfg))
        return self._versions[1]

    def resolve(self, name: str, version: str = "") -> str:
        """The model that serves ``name`` at ``version`` ('' for the model's default): what every
        transport asks before it names a model to the service, so that versions mean the same
        over HTTP, gRPC and MQTT (edged/serving/versions.py). Raises model_not_found, or
        model_version_not_found for a model that exists without that version."""
        return self.versions().resolve(name, version, self.registry.models)

    async def memory_available(self) -> int | None:
        """Free memory now, from the configured probe, off the loop (jtop answers over a socket,
        and can take a second); None when the probe fails (the caller reports without it)."""
        try:
            info = await asyncio.to_thread(probe, self.registry.cfg.memory.probe)
        except Exception as e:
            log.debug("memory probe failed: %s", e)
            return None
        return info.available

    def model_metadata(self, name: str) -> dict[str, Any]:
        """Triton's model metadata. ``versions``: for a model's default, every version of it that
        is ready (as Triton answers without a version); for another version, that one."""
        rt = self.model(name)
        if rt.backend is None:
            raise ModelNotReadyError(f"model '{name}' is {rt.state}" + (f": {rt.reason}" if rt.reason else ""))
        known = self.versions()
        reshape = self.plan_for(rt).reshape
        return {
            "name": known.served(name)[0],
            "versions": known.listed(name, self._is_ready),
            "platform": f"{rt.backend_cls.name if rt.backend_cls else ''}_{rt.precision}",
            "inputs": [_tensor_meta(s.name, s.dtype, shown(reshape, s.name, s.shape, False)) for s in rt.inputs],
            "outputs": [_tensor_meta(s.name, s.dtype, shown(reshape, s.name, s.shape, True)) for s in rt.outputs],
        }

    def as_sent(self, rt: ModelRuntime, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``inputs`` in the model's own shapes, as a client sends them (a repository's reshapes)."""
        reshape = self.plan_for(rt).reshape
        return dict(inputs) if reshape is None else reshape.as_sent(inputs)

    def _is_ready(self, name: str) -> bool:
        rt = self.registry.models.get(name)
        return rt is not None and rt.state == ModelState.READY

    # --- inference ---

    async def decode_infer(
        self, name: str, body: bytes | memoryview, header_length: int | None, shm: ShmResolver | None = None
    ) -> InferRequest:
        """The one decoder both transports call: the model first (an unknown model is a 404
        whatever the body holds), then the body, bounded by the model's own tensor counts and
        decoded off the loop when large, then the requested outputs against the model's."""
        plan = self.plan_for(self.model(name))
        if len(body) <= OFFLOAD_BYTES:
            return decode_now(plan, body, header_length, shm)  # the hot path: no hand-off
        return outputs_checked(plan, await decode_infer_async(body, header_length, shm, plan.limits))

    def infer_now(
        self,
        rt: ModelRuntime,
        plan: ModelPlan,
        inputs: Mapping[str, np.ndarray],
        request_id: str = "",
        transport: str = "http",
        received_ns: int = 0,
        shapes: object = None,
    ) -> dict[str, np.ndarray] | None:
        """``infer`` without awaiting, for a request the loop answers at once: to a model that
        runs inline, serving, no larger than its warm-up's request. None for any other request,
        with no outcome counted (``infer`` serves it); a request that fails here is counted here.
        ``rt`` and ``plan``: the caller's lookup, used only while they are still the model's.
        ``shapes``: the request's InferRequest.shapes (its check remembered by it)."""
        queue = self._serving_queue(rt)
        if queue is None or not queue.inline:
            return None
        if not plan.current(self.registry.cfg, rt) or self.registry.models.get(rt.name) is not rt:
            return None  # a caller's lookup that a reload or a load has overtaken: ``infer`` looks again
        entered = time.perf_counter_ns()
        stats = self.stats.counted(rt.name)
        try:
            inputs = plan.to_model(inputs)
            elements = plan.checked(inputs, shapes)
            rt.last_used = time.monotonic()
            out = queue.run_now(inputs, stats, elements)
        except Exception as e:
            self._failed(rt.name, transport, e, stats, received_ns or entered, entered, request_id)
            raise
        if out is not None:  # else its instance is busy with a larger request, or its queue full
            self._succeeded(rt.name, transport, stats, received_ns or entered, entered)
            out = plan.to_api(out)
        return out

    async def infer(
        self,
        name: str,
        inputs: Mapping[str, np.ndarray],
        request_id: str = "",
        transport: str = "http",
        received_ns: int = 0,
        tried_now: bool = False,
        sink: OutputSink | None = None,
        source: InputSource | None = None,
    ) -> dict[str, np.ndarray]:
        """``received_ns``: when the transport took the request (perf_counter_ns), so its
        decoding counts in the statistics; 0 when there was nothing to decode. ``tried_now``:
        the caller has just had None from ``infer_now`` for it (not tried again). ``sink``: where
        the model's worker puts the outputs, ``source``: where it copies the inputs' bytes from
        before the run (ModelQueue.submit); the inputs are checked here by their shapes and types
        alone, so they may be filled later."""
        rt = self.registry.models.get(name)
        if rt is not None and not tried_now and source is None and rt.queue is not None and rt.queue.inline:
            now = self.infer_now(rt, self.plan_for(rt), inputs, request_id, transport, received_ns)
            if now is not None:
                return now
        entered = time.perf_counter_ns()  # one clock for the statistics and the metrics
        stats = self.stats.counted(name)
        if rt is None:
            self.metrics.reject(name, transport, ModelNotFoundError.code, known=False)
            raise ModelNotFoundError.named(name)
        try:
            queue = self._serving_queue(rt)
            if queue is None:
                rt, queue = await self._await_model(rt)
            plan = self.plan_for(rt)
            assert plan.rules is not None  # READY with a queue: loaded
            inputs = plan.to_model(inputs)
            plan.rules.check(inputs)  # the one check of this request's tensors
            rt.last_used = time.monotonic()
            out = await queue.submit(inputs, plan.timeout_s, request_id, stats, sink, source)
        except Exception as e:
            self._failed(name, transport, e, stats, received_ns or entered, entered, request_id)
            raise
        self._succeeded(name, transport, stats, received_ns or entered, entered)
        return plan.to_api(out)

    def _serving_queue(self, rt: ModelRuntime) -> ModelQueue | None:
        """The queue of a model that serves now; None while it must be waited for. Until READY=1
        every request waits for readiness, even one for a model already warm (except the
        daemon's own warm-up requests, which are what readiness waits for)."""
        # The daemon's own warm-up requests are the ones run uncounted (a client's request that
        # arrives during the warm-up waits, in _await_model, as any before READY=1).
        return rt.queue if rt.state is READY and (self.ready.is_set() or (self.warming and not counted())) else None

    def _succeeded(
        self, name: str, transport: str, stats: ModelStatistics | None, since_ns: int, entered_ns: int
    ) -> None:
        now = time.perf_counter_ns()
        if stats is not None:
            stats.succeeded(since_ns, entered_ns, now)
        self.metrics.observe(name, transport, "ok", (now - entered_ns) / 1e9)

    def _failed(
        self,
        name: str,
        transport: str,
        error: Exception,
        stats: ModelStatistics | None,
        since_ns: int,
        entered_ns: int,
        request_id: str,
    ) -> None:
        now = time.perf_counter_ns()
        if stats is not None:
            stats.failed(since_ns, now)
        code = error.code if isinstance(error, EdgedError) else EdgedError.code
        self.metrics.observe(name, transport, code, (now - entered_ns) / 1e9)
        if isinstance(error, EdgedError):
            log.debug(
                "%s: request %s failed: %s",
                name,
                request_id,
                error.message,
                extra={"model": name, "request_id": request_id},
            )

    def plan_for(self, rt: ModelRuntime) -> ModelPlan:
        """The model's request plan, remembered until the config or its backend changes."""
        cfg = self.registry.cfg
        plan = self._plans.get(rt.name)
        if plan is not None and plan.current(cfg, rt):
            return plan
        plan = self._plans[rt.name] = make_plan(cfg, rt)
        return plan

    async def _await_model(self, rt: ModelRuntime) -> tuple[ModelRuntime, Any]:
        if self.stopping:
            raise ShuttingDownError("edged is shutting down")
        timeout = self.registry.cfg.server.request_timeout_ms / 1000
        deadline = self.loop.time() + timeout
        while (gate := self.registry.holds.get(rt.name)) is not None:
            # A reload is swapping this model and old and new do not fit together: wait for it
            # (and for its rollback, which holds the model again if the swap failed).
            try:
                await asyncio.wait_for(gate.wait(), max(0.0, deadline - self.loop.time()))
            except asyncio.TimeoutError:
                raise ModelNotReadyError(f"model '{rt.name}' is being swapped by a reload") from None
            rt = self.registry.models.get(rt.name, rt)
        if not self.ready.is_set():
            # A request that arrives while the daemon warms up (socket activation queues it in
            # the kernel) waits for readiness rather than failing.
            try:
                await asyncio.wait_for(self.ready.wait(), timeout)
            except asyncio.TimeoutError:
                raise ModelNotReadyError("edged is still starting") from None
            # What serves the model now: the start may have registered another runtime for it
            # meanwhile (a stand-in while its engine builds).
            rt = self.registry.models.get(rt.name, rt)
        # A lazy model loads on its first request (that is what lazy means); one unloaded by an
        # operator stays unloaded until loaded again through the repository API.
        if rt.state.loads_on_demand and rt.entry is not None:
            await self.registry.ensure_loaded(rt, self.loop)
        if rt.state == ModelState.UNLOADED:
            raise ModelNotReadyError(
                f"model '{rt.name}' is unloaded"
                + (f" ({rt.reason})" if rt.reason else "")
                + f"; load it with POST /v2/repository/models/{rt.name}/load"
            )
        if rt.state != ModelState.READY or rt.queue is None:
            raise ModelNotReadyError(f"model '{rt.name}' is {rt.state}" + (f": {rt.reason}" if rt.reason else ""))
        return rt, rt.queue

    # --- repository ---

    def repository_index(self) -> list[dict[str, Any]]:
        """Triton's index: one entry per model version (a repository model's versions each)."""
        known = self.versions()
        out = []
        for rt in self.registry.models.values():
            model, version = known.served(rt.name)
            out.append({"name": model, "version": version, "state": rt.state.upper(), "reason": rt.reason})
        return sorted(out, key=lambda e: (e["name"], int(e["version"])))

    async def load(self, name: str, request: LoadRequest = PLAIN) -> None:
        """Load every version of ``name``; ``request``: what the load request carried (a config,
        files), applied first by ``configured``."""
        if self.configured is not None:
            await self.configured.load(name, request)
        elif request.given:
            raise UnavailableError(f"failed to load '{name}': a load with a config is taken once edged is ready")
        try:
            every = self.versions().every(name, self.registry.models)
        except ModelNotFoundError as e:  # Triton's clients look for these words
            raise ModelNotFoundError(f"failed to load '{name}': {e.message}") from None
        for each in every:
            await self._load_one(each)

    async def _load_one(self, name: str) -> None:
        rt = self.model(name)
        if rt.state == ModelState.READY:
            return
        if rt.entry is None:
            raise ModelNotReadyError(f"model '{name}' cannot load: {rt.reason or 'it has no built engine'}")
        await self.registry.ensure_loaded(rt, self.loop)

    async def unload(self, name: str) -> None:
        if self.configured is not None and await self.configured.unload(name):
            return
        for each in self.versions().every(name, self.registry.models):
            await self._unload_one(each)

    async def _unload_one(self, name: str) -> None:
        rt = self.model(name)
        if rt.state == ModelState.FAILED or rt.backend is None:
            return
        if rt.state in (ModelState.LOADING, ModelState.WARMING):
            # Its warm-up still measures the backend and then starts its queue: unloaded under
            # it, the model would come back READY with no backend (or FAILED, not unloaded).
            raise ModelNotReadyError(f"model '{name}' is {rt.state.value}: unload it once it is ready")
        await self.registry.unload(rt, ModelState.UNLOADED, "unloaded through the repository API")

    # --- status ---

    def status(self) -> dict[str, Any]:
        reg = self.registry
        return {
            "version": __version__,
            "ready": self.is_ready(),
            "status": self.status_line,
            "uptime_s": round(time.time() - self.started, 1),
            "memory": {
                "source": self.memory.source,
                "total_bytes": self.memory.total,
                "available_at_start_bytes": self.memory.available,
                "detail": self.memory.detail,
                "budget_bytes": reg.budget,
                "used_bytes": reg.used(),
            },
            "plan": self.plan.to_dict(),
            "builds": [b.to_dict() for b in reg.runner.active.values()],
            "models": {
                name: dict(
                    rt.to_dict(),
                    **self.metrics.model(name).percentiles(),
                    requests=self.metrics.model(name).requests,
                    repository=origin_doc(reg.cfg, name),
                )
                for name, rt in reg.models.items()
            },
            **{key: section() for key, section in self.sections.items()},
        }


def _tensor_meta(name: str, dtype: str, shape: tuple[int, ...]) -> dict[str, Any]:
    return {"name": name, "datatype": v2_datatype(dtype), "shape": list(shape)}
