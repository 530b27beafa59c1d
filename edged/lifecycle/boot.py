"""Bringing the configured models up at start: resolve, plan, build or stand in, load, warm.

A model whose engine is in the cache loads at once. One whose engine is missing either serves
from a stand-in while its engine builds in the background (the default), or is built first
(``[build] block_ready = true``, and whenever no stand-in exists or the stand-in and the engine
together do not fit the budget). A model whose backend's library is not installed yet waits for
it, outside the plan, and joins after READY=1 once it imports (edged/serving/waiting.py).
Everything blocking runs in threads or the build child.
"""

from __future__ import annotations

import asyncio
import logging

from edged.errors import CacheError, EdgedError
from edged.host import systemd
from edged.serving.admission import Plan, PlanItem, plan
from edged.serving.background import BackgroundBuilds, stand_in
from edged.serving.registry import ModelRuntime, Registry
from edged.serving.states import ModelState

log = logging.getLogger(__name__)

EXTEND_USEC = 90_000_000  # each progress event buys a slow build another 90 s of start timeout


class Boot:
    def __init__(self, registry: Registry, background: BackgroundBuilds, loop: asyncio.AbstractEventLoop) -> None:
        self.registry = registry
        self.background = background
        self.loop = loop
        # Built after READY=1: (runtime to build, load it when built).
        self.later: list[tuple[ModelRuntime, bool]] = []

    async def resolve_all(self) -> None:
        reg = self.registry
        for rt in reg.models.values():
            try:
                # Hashing model files and checking cache entries can take long: never on the loop.
                await asyncio.to_thread(reg.resolve, rt)
            except EdgedError as e:
                reg.set_state(rt, ModelState.FAILED, e.message)
            else:
                if rt.waits_for:
                    reg.set_state(rt, ModelState.WAITING, rt.backend_reason)

    async def _stand_ins(self, candidates: list[ModelRuntime]) -> dict[str, ModelRuntime]:
        if self.registry.cfg.build.block_ready:
            return {}
        found = {}
        for rt in candidates:
            if rt.entry is None and rt.cfg.preload == "boot":
                sub = await asyncio.to_thread(stand_in, self.registry, rt)
                if sub is not None:
                    found[rt.name] = sub
        return found

    def plan(self, candidates: list[ModelRuntime], subs: dict[str, ModelRuntime]) -> Plan:
        """Plan with stand-in + engine counted for models that will swap; a model for which both
        do not fit, but the engine alone does, is built first instead (as with block_ready)."""
        budget = self.registry.budget

        def items() -> list[PlanItem]:
            out = []
            for rt in candidates:
                item = rt.plan_item()
                if rt.name in subs:
                    item = PlanItem(
                        item.name, item.priority, item.preload, item.footprint + subs[rt.name].footprint, False
                    )
                out.append(item)
            return out

        first = plan(items(), budget)
        for name in list(subs):
            if name in first.deferred:
                log.info("%s: stand-in and engine together exceed the budget; building first", name)
                del subs[name]
        return plan(items(), budget)

    async def boot(self) -> Plan:
        reg = self.registry
        await self.resolve_all()
        candidates = [rt for rt in reg.models.values() if rt.state not in (ModelState.FAILED, ModelState.WAITING)]
        subs = await self._stand_ins(candidates)
        the_plan = self.plan(candidates, subs)
        for name, why in the_plan.deferred.items():
            reg.set_state(reg.models[name], ModelState.DEFERRED, why)
        blocking = [rt for rt in candidates if rt.entry is None and rt.name not in subs]
        if not reg.cfg.build.block_ready:
            # Only the models that will serve at boot are worth waiting for; the others (lazy,
            # deferred) build after READY=1.
            self.later += [(rt, False) for rt in blocking if rt.name not in the_plan.admitted]
            blocking = [rt for rt in blocking if rt.name in the_plan.admitted]
        for i, rt in enumerate(blocking, 1):
            await self.build(rt, i, len(blocking))
        for name in the_plan.admitted:
            await self._bring_up(reg.models[name], subs.get(name))
        for name in the_plan.lazy:
            if reg.models[name].entry is not None:
                reg.set_state(reg.models[name], ModelState.LAZY, "loads on first request")
        await asyncio.to_thread(reg.digests.save)
        return the_plan

    async def _bring_up(self, rt: ModelRuntime, sub: ModelRuntime | None) -> None:
        reg = self.registry
        if sub is not None:
            systemd.status(f"loading {rt.name} on {sub.serving_on} while its engine builds")
            reg.models[rt.name] = sub
            try:
                await reg.load(sub, self.loop)
            except EdgedError as e:
                # Nothing serves the model then: as for a model with no stand-in, its engine is
                # built now, so that READY=1 keeps its rule (every boot model settled, one serving).
                log.warning("%s: the stand-in does not load (%s); building it now", rt.name, e.message)
                reg.models[rt.name] = rt
                await self.build(rt, 1, 1)
            else:
                self.background.announce(rt)
                self.later.append((rt, True))
                return
        if rt.entry is not None:
            systemd.status(f"loading {rt.name}")
            await self.load_or_rebuild(rt)

    def start_later(self) -> None:
        """After READY=1: the builds that did not block it, and the models waiting for a backend."""
        for rt, load in self.later:
            self.background.submit(rt, load)
        self.later.clear()
        self.background.watch_backends()

    async def load_or_rebuild(self, rt: ModelRuntime) -> None:
        """An engine that checked out but will not load (another TensorRT, a corrupt plan) has
        been moved aside by the registry: build it again once, then load that."""
        reg = self.registry
        try:
            await reg.load(rt, self.loop)
            return
        except CacheError as e:
            log.warning("%s: %s; rebuilding", rt.name, e.message, extra={"model": rt.name})
        except EdgedError as e:
            reg.set_state(rt, ModelState.FAILED, e.message)
            return
        await self.build(rt, 1, 1)
        if rt.entry is None:
            return
        try:
            await reg.load(rt, self.loop)
        except EdgedError as e:
            reg.set_state(rt, ModelState.FAILED, e.message)

    async def build(self, rt: ModelRuntime, index: int, total: int) -> None:
        reg = self.registry
        label = f"building {rt.name} {rt.precision} ({index}/{total})"
        systemd.status(label)
        systemd.extend_timeout(EXTEND_USEC)

        def progress(phase: str, fraction: float | None) -> None:
            _progress(label, phase, fraction)

        try:
            await reg.build(rt, progress)
        except EdgedError as e:
            reg.set_state(rt, ModelState.FAILED, e.message)
            log.error("%s: %s", rt.name, e.message, extra={"model": rt.name})
        else:
            if rt.state not in (ModelState.DEFERRED, ModelState.FAILED):
                reg.set_state(rt, ModelState.BUILT)


def _progress(label: str, phase: str, fraction: float | None) -> None:
    pct = f" {fraction * 100:.0f}%" if fraction is not None else ""
    systemd.status(f"{label}: {phase}{pct}")
    systemd.extend_timeout(EXTEND_USEC)
