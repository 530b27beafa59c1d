"""Builds that never block serving.

A model whose engine is missing (a new model, a changed one, every model after a TensorRT or
JetPack upgrade) serves at once from a stand-in that needs no build: an engine of another precision
already in the cache, or the FP32 model on ONNX Runtime on the CPU. Its engine builds in the child
process meanwhile; once it passed its gate it is loaded and warmed beside the stand-in, swapped in
with one dict assignment (as a reload does) and the stand-in is drained and released. Builds run
one at a time, in the order they were asked for.

A model that waited for its backend's library (edged/serving/waiting.py) comes through here too,
once the library imports: its waiting runtime stays registered (nothing serves it, but its reason
says which step is under way) while the new one builds, loads and warms, then is swapped in.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from edged import backends
from edged.cache.store import Entry
from edged.config import ModelConfig, format_size
from edged.errors import BackendUnavailableError, EdgedError
from edged.quantize.job import job_key
from edged.serving.registry import ModelRuntime, Registry
from edged.serving.states import ModelState
from edged.serving.swap import retire, swap_held
from edged.serving.waiting import BackendWaits

log = logging.getLogger(__name__)

WHY = "replaced by its built engine"  # the reason the retired runtime shows
SETTLE_POLL_S = 0.2  # how often ``settled`` looks (a build takes seconds to minutes)


def stand_in(reg: Registry, rt: ModelRuntime) -> ModelRuntime | None:
    """A runtime that serves ``rt`` now, without a build; None when there is none. Blocking (a
    cache lookup may hash an artefact): run it in a thread."""
    cls, job = rt.backend_cls, rt.job
    if cls is None or job is None:
        return None
    wanted = f"{cls.name} {rt.precision}"
    for precision in ("fp16", "fp32"):
        if precision == rt.precision or (precision not in cls.precisions and precision != "fp32"):
            continue
        other = job.at_precision(precision)
        entry = reg.cache.lookup(rt.name, job_key(other, cls), cls.artifact_suffix)
        if entry is not None and entry.manifest.get("artifact"):
            return _make(rt, cls, precision, entry, wanted, f"the {precision} engine already built")
    if Path(rt.cfg.path).suffix.lower() != ".onnx":
        return None  # ONNX Runtime runs ONNX models only (a GGUF has nothing to stand in for it)
    try:
        ort = backends.backend_class("onnxruntime")
    except BackendUnavailableError:
        return None
    # The source model itself: ONNX Runtime loads it as it is. Its "entry" is not a cache entry
    # (no key, never rewritten).
    source = Path(rt.cfg.path)
    return _make(rt, ort, "fp32", Entry("", source, source, {}), wanted, "the source model")


def _make(rt: ModelRuntime, cls: type, precision: str, entry: Entry, wanted: str, what: str) -> ModelRuntime:
    sub = ModelRuntime(rt.name, rt.cfg, job=rt.job, stands_in_for=wanted)
    sub.backend_cls, sub.backend_reason = cls, f"stand-in: {what}, while {wanted} builds"
    sub.precision, sub.entry = precision, entry
    if entry.manifest.get("footprint"):
        sub.footprint, sub.measured = int(entry.manifest["footprint"]), True
    else:
        sub.footprint = os.path.getsize(entry.artifact) * (1 + rt.cfg.instances)
    return sub


class BackgroundBuilds:
    """The queue of builds that run while their models serve on stand-ins (or wait, if lazy)."""

    def __init__(
        self,
        registry: Registry,
        loop: asyncio.AbstractEventLoop,
        on_change: Callable[[], None],
        on_swap: Callable[[], None],
    ) -> None:
        self.registry = registry
        self.loop = loop
        self._on_change = on_change  # status text changed (STATUS=, status line)
        self._on_swap = on_swap  # a new engine serves (collect old generations)
        self.targets: dict[str, tuple[ModelRuntime, bool]] = {}  # name → (runtime to build, load it)
        self._task: asyncio.Task[None] | None = None
        self._current = ""
        self.waits = BackendWaits(registry, loop, self.submit, lambda name: name in self.targets, on_change)

    def target(self, name: str) -> ModelRuntime | None:
        item = self.targets.get(name)
        return item[0] if item else None

    def submit(self, target: ModelRuntime, load: bool) -> None:
        """Build ``target`` in the background; ``load``: warm it and swap it in when built."""
        if target.name == self._current and self._task is not None:
            # The same model asked again (a reload changed it mid-build): start over.
            self._task.cancel()
            self._task = None
        self.targets[target.name] = (target, load)
        self._describe(target, "queued", None)
        if self._task is None or self._task.done():
            self._task = self.loop.create_task(self._run())

    async def settled(
        self, name: str, cfg: ModelConfig, timeout_s: float, gating: Callable[[], None] | None = None
    ) -> str | None:
        """Wait for the build a reload started for ``name`` to serve ``cfg``: None once it
        serves, else why not (its build or load failed, and what served before still serves).
        ``gating``: called while the build's accuracy gate runs."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            rt = self.registry.models.get(name)
            target = self.target(name)
            if rt is None:
                return "the model is gone after the reload"
            if target is not None and target.cfg == cfg:
                if gating is not None and "accuracy gate" in rt.reason:
                    gating()
            elif rt.cfg != cfg:  # the build or the load failed: the old version still serves
                return rt.reason.split("the build failed: ", 1)[-1] or "the build failed"
            elif rt.state == ModelState.FAILED:
                return rt.reason or "failed"
            elif not rt.stands_in_for and (rt.state.serving or rt.state == ModelState.DEFERRED):
                return None
            await asyncio.sleep(SETTLE_POLL_S)
        return "the build did not finish in time"

    def announce(self, target: ModelRuntime) -> None:
        """Say on the serving runtime that ``target`` will build (before the build is queued)."""
        self._describe(target, "queued", None)

    def cancel(self, name: str) -> None:
        self.targets.pop(name, None)
        if name == self._current and self._task is not None:
            self._task.cancel()
            self._task = None
            if self.targets:
                self._task = self.loop.create_task(self._run())

    def watch_backends(self) -> None:
        """Start looking for the libraries of the models that wait for them (after READY=1)."""
        self.waits.start()

    async def stop(self) -> None:
        await self.waits.stop()
        self.targets.clear()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while self.targets:
            name = next(iter(self.targets))
            target, load = self.targets[name]
            self._current = name
            try:
                await self._build_and_swap(target, load)
            except EdgedError as e:
                self._failed(target, e.message)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # caught here, at the task's boundary: logged once, never lost
                log.exception("%s: background build failed", name, extra={"model": name})
                self._failed(target, f"{e.__class__.__name__}: {e}")
            finally:
                if self._task is asyncio.current_task():  # a cancelled run ends after its successor began
                    self._current = ""
            if self.targets.get(name, (None,))[0] is target:
                del self.targets[name]
            self._on_change()

    # --- one model ---

    def _describe(self, target: ModelRuntime, phase: str, fraction: float | None) -> None:
        reg = self.registry
        current = reg.models.get(target.name)
        if current is None or current is target:
            return
        wanted = f"{target.backend_cls.name if target.backend_cls else '?'} {target.precision}"
        pct = f"{fraction * 100:.0f}%" if fraction is not None else phase
        if current.state == ModelState.WAITING:  # nothing serves it yet: say how far it got
            text = f"backend {current.waits_for} imports; building {wanted} ({pct})"
        else:
            text = f"serving on {current.serving_on} while building {wanted} ({pct})"
        phase_changed = current.reason.split(" (")[0] != text.split(" (")[0]
        if current.state in (ModelState.READY, ModelState.WAITING) and phase_changed:
            reg.set_state(current, current.state, text)  # logged and published once per phase
        current.reason = text
        self._on_change()

    async def _build_and_swap(self, target: ModelRuntime, load: bool) -> None:
        reg = self.registry
        await reg.build(target, lambda phase, fraction: self._describe(target, phase, fraction))
        current = reg.models.get(target.name)
        if current is target or current is None:
            await self._settle_unserved(target, load)
            return
        if current.state == ModelState.WAITING:
            await self._replace_waiting(current, target, load)
            return
        if not load:
            return
        if target.footprint > reg.budget - reg.used():
            # The two do not fit together; a failed load puts the serving one back at once.
            await swap_held(reg, current, target, self.loop, WHY, lambda old, _: reg.load(old, self.loop))
        else:
            await reg.load(target, self.loop)
            if reg.models.get(target.name) is not current:  # a reload replaced it meanwhile
                await reg.unload(target, notify=False)
                return
            reg.models[target.name] = target  # the swap: the next request runs on the new engine
        reg.set_state(target, ModelState.READY)
        log.info(
            "%s: now serving on %s (was %s)",
            target.name,
            target.serving_on,
            current.serving_on,
            extra={"model": target.name},
        )
        await retire(reg, current, WHY)
        self._on_swap()

    async def _replace_waiting(self, waiting: ModelRuntime, target: ModelRuntime, load: bool) -> None:
        """The model whose backend arrived: loaded and warmed while ``waiting`` stays registered,
        then swapped in; a lazy one, or one the budget has no room for now, is registered as such."""
        reg = self.registry
        free = reg.budget - reg.used()
        if not load or target.footprint > free:
            reg.models[target.name] = target
            if target.cfg.preload == "lazy":
                reg.set_state(target, ModelState.LAZY, "loads on first request")
            else:
                why = f"over the memory budget: needs {format_size(target.footprint)}, {format_size(max(0, free))} free"
                reg.set_state(target, ModelState.DEFERRED, why)
            return
        reg.set_state(
            waiting, ModelState.WAITING, f"backend {waiting.waits_for} imports; loading and warming {target.serving_on}"
        )
        await reg.load(target, self.loop)
        if reg.models.get(target.name) is not waiting:  # a reload replaced it meanwhile
            await reg.unload(target, notify=False)
            return
        reg.models[target.name] = target
        reg.set_state(target, ModelState.READY)
        log.info("%s: now serving on %s", target.name, target.serving_on, extra={"model": target.name})
        self._on_swap()

    async def _settle_unserved(self, target: ModelRuntime, load: bool) -> None:
        """A model that had no stand-in (lazy, deferred, or its stand-in failed) is built."""
        reg = self.registry
        if load:
            await reg.load(target, self.loop)  # a failure is reported by _run
            self._on_swap()
        elif target.cfg.preload == "lazy":
            reg.set_state(target, ModelState.LAZY, "loads on first request")
        elif target.state == ModelState.BUILDING:
            reg.set_state(target, ModelState.DEFERRED, "built in the background; over the memory budget")

    def _failed(self, target: ModelRuntime, message: str) -> None:
        reg = self.registry
        current = reg.models.get(target.name)
        log.error("%s: %s", target.name, message, extra={"model": target.name})
        if current is None or current is target:
            reg.set_state(target, ModelState.FAILED, message)
        elif current.state == ModelState.WAITING:  # its backend came, the model does not load
            reg.models[target.name] = target
            reg.set_state(target, ModelState.FAILED, message)
        elif current.state == ModelState.READY:
            reg.set_state(current, ModelState.READY, f"serving on {current.serving_on}; the build failed: {message}")
