"""Reload: re-read the config, build and warm what changed beside the old models, swap, drain.

Triggered by SIGHUP (``systemctl reload``) or by a config or model file changing on disk. The old
models keep serving until their replacements are warm; the swap is one dict assignment on the
event loop, so a request sees either the old model or the new one. Old models are unloaded once
the requests already inside them have finished. When old and new together do not fit the budget,
that model's requests are held (not failed) while the old one is unloaded and the new one loaded.
A reload that fails (bad config, failed build or gate, no memory) keeps everything serving and
says why in STATUS= and the log.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from edged import systemd
from edged.config import Config, format_size, load
from edged.errors import EdgedError
from edged.registry import FAILED, LAZY, READY, ModelRuntime, Registry

log = logging.getLogger(__name__)


@dataclass
class Diff:
    added: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    restart_needed: list[str] = field(default_factory=list)


def diff_configs(old: Config, new: Config) -> Diff:
    """What a reload has to do; keys that only a restart can apply are listed, not applied."""
    d = Diff()
    d.added = sorted(set(new.models) - set(old.models))
    d.removed = sorted(set(old.models) - set(new.models))
    d.changed = sorted(n for n in set(old.models) & set(new.models) if old.models[n] != new.models[n])
    for section in ("server", "cache", "mqtt"):
        if getattr(old, section) != getattr(new, section):
            d.restart_needed.append(section)
    return d


class Reloader:
    def __init__(
        self,
        registry: Registry,
        loop: asyncio.AbstractEventLoop,
        summary: Callable[[], str],
        set_status: Callable[[str], None],
    ) -> None:
        self.registry = registry
        self.loop = loop
        self._summary = summary
        self._set_status = set_status
        self._lock = asyncio.Lock()
        self._stamps: dict[str, tuple[int, int]] = {}
        self.last_error = ""

    # --- triggering ---

    def request(self, why: str) -> asyncio.Task[bool]:
        log.info("reload requested: %s", why)
        return self.loop.create_task(self.reload())

    def _paths(self) -> list[str]:
        cfg = self.registry.cfg
        return [cfg.source, *(m.path for m in cfg.models.values())]

    def snapshot(self) -> None:
        self._stamps = {p: _stamp(p) for p in self._paths()}

    async def watch(self, stop: asyncio.Event) -> None:
        """Poll the config and model files; a change (replaced, rewritten) triggers a reload."""
        self.snapshot()
        interval = self.registry.cfg.lifecycle.watch_interval_s
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), interval)
                return
            except asyncio.TimeoutError:
                pass
            changed = [p for p in self._paths() if _stamp(p) != self._stamps.get(p)]
            if changed and not self._lock.locked():
                await self.request(f"changed on disk: {', '.join(changed)}")

    # --- the reload ---

    async def reload(self) -> bool:
        async with self._lock:
            systemd.reloading("reloading configuration")
            started = time.monotonic()
            try:
                await self._reload()
            except EdgedError as e:
                self.last_error = e.message
                log.error("reload failed, the old models keep serving: %s", e.message)
                self._set_status(f"{self._summary()}; reload failed: {e.message}")
                systemd.ready(self.registry_status())
                self.snapshot()
                return False
            self.last_error = ""
            self.snapshot()
            self._set_status(self._summary())
            systemd.ready(self.registry_status())
            log.info("reload done in %.2f s", time.monotonic() - started)
            return True

    def registry_status(self) -> str:
        return self._summary() + (f"; reload failed: {self.last_error}" if self.last_error else "")

    async def _reload(self) -> None:
        reg = self.registry
        path = reg.cfg.source
        if not path or not os.path.exists(path):
            raise EdgedError(f"the config file {path!r} is gone")
        new_cfg = load(path)
        d = diff_configs(reg.cfg, new_cfg)
        if d.restart_needed:
            log.warning("changes to [%s] take effect at the next restart", ", ".join(d.restart_needed))
        candidates = {n: ModelRuntime(n, new_cfg.models[n]) for n in d.added + d.changed}
        # A model whose file changed on disk has the same config but a new cache key.
        for name in set(new_cfg.models) - set(candidates) - set(d.removed):
            fresh = ModelRuntime(name, new_cfg.models[name])
            reg.resolve(fresh)
            old = reg.models[name]
            if fresh.job and old.job and fresh.job.source_digest != old.job.source_digest:
                candidates[name] = fresh
        for rt in candidates.values():
            if rt.backend_cls is None:
                reg.resolve(rt)
        await self._prepare(candidates)
        reg.cfg = new_cfg
        for rt in candidates.values():
            await self._swap_in(rt)
        for name in d.removed:
            old = reg.models.pop(name)
            await self._retire(old)
        reg.digests.save()

    async def _prepare(self, candidates: dict[str, ModelRuntime]) -> None:
        """Build every new engine first: a failed build leaves the old config fully in place."""
        reg = self.registry
        for rt in candidates.values():
            if rt.entry is None:
                self._set_status(f"reloading: building {rt.name} {rt.precision}")
                await reg.build(rt, self._progress(rt.name))

    def _progress(self, name: str) -> Callable[[str, float | None], None]:
        return lambda phase, fraction: self._set_status(f"reloading: {name}: {phase}")

    async def _swap_in(self, new: ModelRuntime) -> None:
        reg = self.registry
        old = reg.models.get(new.name)
        if new.cfg.preload == "lazy" and (old is None or old.state != READY):
            reg.models[new.name] = new
            reg.set_state(new, LAZY, "loads on first request")
            if old is not None:
                await self._retire(old)
            return
        free = reg.budget - reg.used()
        if new.footprint <= free:
            await self._load_beside(new, old)
        elif old is not None and new.footprint <= free + old.footprint:
            await self._swap_queued(new, old)
        else:
            raise EdgedError(
                f"{new.name}: the new version needs {format_size(new.footprint)}, "
                f"{format_size(max(free, 0))} of the budget is free"
            )

    async def _load_beside(self, new: ModelRuntime, old: ModelRuntime | None) -> None:
        """Both fit: warm the new one while the old one serves, then swap and drain the old."""
        reg = self.registry
        self._set_status(f"reloading: warming {new.name}")
        await reg.load(new, self.loop)
        reg.models[new.name] = new  # the swap: the next request sees the new model
        if old is not None:
            await self._retire(old)

    async def _swap_queued(self, new: ModelRuntime, old: ModelRuntime) -> None:
        """Old and new do not fit together: hold this model's requests, unload, load, release."""
        reg = self.registry
        log.warning(
            "%s: old and new versions do not fit together; requests wait during the swap",
            new.name,
            extra={"model": new.name},
        )
        gate = reg.hold(new.name)
        try:
            await self._retire(old)
            reg.models[new.name] = new
            await reg.load(new, self.loop)
        except EdgedError as e:
            reg.set_state(new, FAILED, e.message)
            raise
        finally:
            reg.release(new.name, gate)

    async def _retire(self, old: ModelRuntime) -> None:
        """Let the requests already queued for the old model finish, then unload it."""
        reg = self.registry
        queue = old.queue
        deadline = time.monotonic() + reg.cfg.lifecycle.drain_timeout_s
        while queue is not None and queue.pending and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        if old.backend is not None:
            await reg.unload(old, "unloaded", "replaced by reload", notify=reg.models.get(old.name) is old)


def _stamp(path: str) -> tuple[int, int]:
    try:
        st = os.stat(path)
    except OSError:
        return (0, 0)
    return (st.st_mtime_ns, st.st_ino)
