"""Reload: re-read the config, build and warm what changed beside the old models, swap, drain.

Triggered by SIGHUP (``systemctl reload``) or by a config or model file changing on disk. A reload
is one transaction: every changed model is resolved, built (or given a stand-in) and warmed beside
the old ones first; only when all of that succeeded is the new config applied and every model
swapped at once (dict assignments on the event loop, so a request sees either the old model or the
new one). A model whose engine will build after the commit is first loaded from what stands in for
it, so a file that cannot be served fails the reload, naming it. Any failure unloads what the
reload loaded and leaves the old config and models exactly as they were; the failure stays in
STATUS= and the status line until a later reload succeeds.
When old and new together do not fit the budget, that model's requests are held (not failed)
while the old one is unloaded and the new one loaded; a failure then loads the old one back.
Unless ``[build] block_ready`` is set, an engine that must be built does not hold the reload: the
old version (or a stand-in) serves while it builds in the background, then is swapped.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from edged.config import Config, ServerConfig, format_size
from edged.errors import EdgedError
from edged.host import systemd
from edged.llm.gguf_header import read_header
from edged.quantize.job import job_key
from edged.repository.load import load_config
from edged.repository.translate import Override
from edged.serving.background import BackgroundBuilds, stand_in
from edged.serving.registry import ModelRuntime, Registry
from edged.serving.states import ModelState
from edged.serving.swap import hold, release, retire, swap_held

log = logging.getLogger(__name__)

WHY = "replaced by reload"  # the reason a retired runtime shows


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
    # A reload applies a new model repository (its models are added and removed like any).
    if _restart_only(old.server) != _restart_only(new.server):
        d.restart_needed.append("server")
    if old.mqtt != new.mqtt:
        d.restart_needed.append("mqtt")
    if old.cache.dir != new.cache.dir:
        d.restart_needed.append("cache.dir")
    return d


@dataclass
class _Txn:
    """What a reload did before its commit, so that a failure can undo all of it."""

    loaded: list[ModelRuntime] = field(default_factory=list)  # new runtimes warm beside the old
    swapped: list[tuple[ModelRuntime, ModelRuntime]] = field(default_factory=list)  # (old, new), queued
    serve: dict[str, ModelRuntime] = field(default_factory=dict)  # name → runtime to register
    build: list[tuple[ModelRuntime, bool]] = field(default_factory=list)  # background builds to start
    # Holds taken when a held swap failed: the model's requests keep waiting until the rollback
    # has loaded the old runtime back (released they would find it unloaded and fail).
    holds: dict[str, asyncio.Event] = field(default_factory=dict)


class Reloader:
    def __init__(
        self,
        registry: Registry,
        loop: asyncio.AbstractEventLoop,
        summary: Callable[[], str],
        set_status: Callable[[str], None],
        background: BackgroundBuilds,
    ) -> None:
        self.registry = registry
        self.loop = loop
        self._summary = summary
        self._set_status = set_status
        self.background = background
        self._lock = asyncio.Lock()
        self._stamps: dict[str, tuple[int, int]] = {}
        self.last_error = ""
        # Laid over every config read from the file: the fleet agent's bundles (edged/fleet/agent.py).
        self.overlay: Callable[[Config], Config] | None = None
        # Repository models that a load request configured (edged/lifecycle/model_loads.py).
        self.replaced: dict[str, Override] = {}

    # --- triggering ---

    def request(self, why: str) -> asyncio.Task[bool]:
        log.info("reload requested: %s", why)
        return self.loop.create_task(self.reload())

    def _paths(self) -> list[str]:
        cfg = self.registry.cfg
        return [cfg.source, *(m.path for m in cfg.models.values()), *_repository_paths(cfg)]

    def snapshot(self, seen: dict[str, tuple[int, int]] | None = None) -> None:
        """What the watcher compares with. ``seen``: the stamps taken as a reload began, kept for
        the paths it had, so that a change made while it ran still triggers the next one."""
        seen = seen or {}
        self._stamps = {p: seen[p] if p in seen else _stamp(p) for p in self._paths()}

    def changed(self) -> list[str]:
        """The watched paths replaced or rewritten since the last snapshot."""
        return [p for p in self._paths() if _stamp(p) != self._stamps.get(p)]

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
            changed = self.changed()
            if changed and not self._lock.locked():
                await self.request(f"changed on disk: {', '.join(changed)}")

    # --- the reload ---

    async def reload(self) -> bool:
        async with self._lock:
            # A stat per watched path (every model version of a repository): off the loop, and
            # before systemd hears of the reload, so a cancellation here leaves nothing to undo.
            seen = await asyncio.to_thread(lambda: {p: _stamp(p) for p in self._paths()})
            systemd.reloading("reloading configuration")
            started = time.monotonic()
            try:
                await self._reload()
            except EdgedError as e:
                return self._failed(e.message, seen)
            except asyncio.CancelledError:
                systemd.ready(self.registry_status())  # never leave systemd in "reloading"
                raise
            except Exception as e:  # caught at the task's boundary: the watcher and the daemon live on
                log.exception("reload failed")
                return self._failed(f"{e.__class__.__name__}: {e}", seen)
            self.last_error = ""
            self.snapshot(seen)
            self._set_status(self._summary())
            systemd.ready(self.registry_status())
            log.info("reload done in %.2f s", time.monotonic() - started)
            return True

    def _failed(self, message: str, seen: dict[str, tuple[int, int]]) -> bool:
        self.last_error = message
        log.error("reload failed, everything stays as it was: %s", message)
        self._set_status(self._summary())
        systemd.ready(self.registry_status())
        self.snapshot(seen)
        return False

    def registry_status(self) -> str:
        text = self._summary()
        if self.last_error and "reload failed" not in text:
            text += f"; reload failed: {self.last_error}"
        return text

    async def _reload(self) -> None:
        reg = self.registry
        path = reg.cfg.source
        if not path or not await asyncio.to_thread(os.path.exists, path):
            raise EdgedError(f"the config file {path!r} is gone")
        replaced = dict(self.replaced)  # the thread reads a copy that nothing changes under it
        new_cfg = await asyncio.to_thread(load_config, path, reg.cfg.repository_arg, replaced=replaced)
        if self.overlay is not None:
            new_cfg = self.overlay(new_cfg)
        d = diff_configs(reg.cfg, new_cfg)
        if d.restart_needed:
            log.warning("changes to [%s] take effect at the next restart", ", ".join(d.restart_needed))
        # Resolving hashes changed files and checks cache entries: in a thread.
        candidates = await asyncio.to_thread(self._candidates, new_cfg, d)
        txn = _Txn()
        try:
            await self._prepare(candidates, new_cfg, txn)
        except BaseException:
            await asyncio.shield(self._rollback(txn))
            raise
        retired = self._commit(new_cfg, txn)
        for rt, load_it in txn.build:
            self.background.submit(rt, load_it)
        for name in d.removed:
            self.background.cancel(name)
            retired.append(reg.models.pop(name))
        for old in retired:
            await retire(reg, old, WHY)
        await asyncio.to_thread(reg.digests.save)

    def _candidates(self, new_cfg: Config, d: Diff) -> list[ModelRuntime]:
        """Changed and added models, and those whose cache key moved (a model file rewritten in
        place, a new generation tag, another device fingerprint)."""
        reg = self.registry
        tag = new_cfg.cache.generation_tag
        out = []
        for name in sorted(set(new_cfg.models) - set(d.removed)):
            fresh = ModelRuntime(name, new_cfg.models[name])
            reg.resolve(fresh, tag)
            if name in d.added or name in d.changed or self._key(fresh) != self._current_key(name):
                out.append(fresh)
        return out

    @staticmethod
    def _key(rt: ModelRuntime) -> str | None:
        return job_key(rt.job, rt.backend_cls) if rt.job and rt.backend_cls else None

    def _current_key(self, name: str) -> str | None:
        target = self.background.target(name)
        return self._key(target or self.registry.models[name])

    async def _prepare(self, candidates: list[ModelRuntime], new_cfg: Config, txn: _Txn) -> None:
        """Build (block_ready) or find stand-ins, then load and warm: everything before the commit."""
        reg = self.registry
        queued = []
        for rt in candidates:
            old = reg.models.get(rt.name)
            if rt.waits_for:  # its backend's library is not importable yet: it waits, as at boot
                txn.serve[rt.name] = rt
                continue
            if rt.entry is None and new_cfg.build.block_ready:
                self._status(f"reloading: building {rt.name} {rt.precision}")
                await reg.build(rt, self._progress(rt.name))
            if rt.entry is None:
                self._plan_build(rt, old, txn)
                continue
            if rt.cfg.preload == "lazy" and (old is None or old.state != ModelState.READY):
                txn.serve[rt.name] = rt
                continue
            free = reg.budget - reg.used()
            if rt.footprint <= free:
                self._status(f"reloading: warming {rt.name}")
                await reg.load(rt, self.loop)
                txn.loaded.append(rt)
                txn.serve[rt.name] = rt
            elif old is not None and old.backend is not None and rt.footprint <= free + old.footprint:
                queued.append((old, rt))
            else:
                raise EdgedError(
                    f"{rt.name}: the new version needs {format_size(rt.footprint)}, "
                    f"{format_size(max(free, 0))} of the budget is free"
                )
        for rt, _ in txn.build:
            # What stands in for it while it builds: loaded to serve, or at least to show that the
            # new file serves (each looked up and loaded once).
            sub = await asyncio.to_thread(stand_in, reg, rt)
            if not await self._stand_in(rt, sub, txn):
                await self._check_loads(rt, sub)
        for old, rt in queued:  # last: these are the only steps that touch what serves
            await self._swap_queued(old, rt, txn)

    async def _check_loads(self, rt: ModelRuntime, sub: ModelRuntime | None) -> None:
        """A model whose engine builds after the commit, and whose stand-in ``sub`` does not serve
        meanwhile, must still load now, or the reload fails naming it: the build alone would find
        out minutes later, the rest applied."""
        if rt.backend_cls is not None and rt.backend_cls.name == "llama":
            try:  # nothing stands in for a language model: its header says whether it is one
                await asyncio.to_thread(read_header, rt.cfg.path)
            except EdgedError as e:
                raise _cannot_serve(rt, e) from None
            return
        if sub is None:
            return
        self._status(f"reloading: checking that {rt.name} loads")
        try:
            await asyncio.to_thread(self.registry.check_loads, sub)
        except EdgedError as e:
            raise _cannot_serve(rt, e) from None

    def _plan_build(self, rt: ModelRuntime, old: ModelRuntime | None, txn: _Txn) -> None:
        boot = rt.cfg.preload == "boot"
        if old is not None and old.state == ModelState.READY and old.backend is not None:
            txn.build.append((rt, boot))  # the old version serves until the new engine is built
        else:
            txn.serve[rt.name] = rt
            txn.build.append((rt, boot))

    async def _stand_in(self, rt: ModelRuntime, sub: ModelRuntime | None, txn: _Txn) -> bool:
        """A new model (or one that did not serve) gets its stand-in ``sub`` while its engine
        builds, where it fits; True when it was loaded (a failure raises)."""
        reg = self.registry
        if txn.serve.get(rt.name) is not rt or rt.cfg.preload != "boot":
            return False
        if sub is None or sub.footprint > reg.budget - reg.used():
            return False
        self._status(f"reloading: warming {rt.name} on {sub.serving_on}")
        try:
            await reg.load(sub, self.loop)
        except EdgedError as e:
            raise _cannot_serve(rt, e) from None
        txn.loaded.append(sub)
        txn.serve[rt.name] = sub
        return True

    def _progress(self, name: str) -> Callable[[str, float | None], None]:
        return lambda phase, fraction: self._status(f"reloading: {name}: {phase}")

    def _status(self, text: str) -> None:
        """A step of this reload; the last failure stays visible until a reload succeeds."""
        self._set_status(text + (f"; reload failed: {self.last_error}" if self.last_error else ""))

    async def _swap_queued(self, old: ModelRuntime, new: ModelRuntime, txn: _Txn) -> None:
        """Old and new do not fit together: swap them under a hold. Once the old one is retired
        the swap is the transaction's to undo: a failed load, or a failure anywhere later, rolls
        it back (``_rollback`` loads the old one again, under a hold of its own)."""

        async def roll_back_later(old: ModelRuntime, new: ModelRuntime) -> None:
            txn.swapped.append((old, new))
            txn.holds[old.name] = hold(self.registry, old.name)  # taken before swap_held lets go

        await swap_held(self.registry, old, new, self.loop, WHY, roll_back_later)
        txn.swapped.append((old, new))

    async def _rollback(self, txn: _Txn) -> None:
        reg = self.registry
        for rt in txn.loaded:
            if rt.backend is not None:
                await reg.unload(rt, notify=False)
        for old, new in reversed(txn.swapped):
            held = txn.holds.pop(old.name, None) or hold(reg, old.name)
            try:
                if new.backend is not None:
                    await reg.unload(new, notify=False)
                reg.models[old.name] = old
                await reg.load(old, self.loop)
            except EdgedError as e:
                reg.set_state(old, ModelState.FAILED, f"could not be restored after a failed reload: {e.message}")
            finally:
                release(reg, old.name, held)
        for name, held in txn.holds.items():  # never left holding requests
            release(reg, name, held)
        txn.holds.clear()

    def _commit(self, new_cfg: Config, txn: _Txn) -> list[ModelRuntime]:
        """Apply the new config and swap every model at once (no await in here)."""
        reg = self.registry
        reg.cfg = new_cfg
        retired = []
        for name, rt in txn.serve.items():
            old = reg.models.get(name)
            reg.models[name] = rt
            if old is not None and old is not rt:
                retired.append(old)
            if rt.waits_for and rt.backend_cls is None:
                reg.set_state(rt, ModelState.WAITING, rt.backend_reason)
            elif rt.backend is None and rt.entry is not None and rt.cfg.preload == "lazy":
                reg.set_state(rt, ModelState.LAZY, "loads on first request")
            elif rt.backend is None and rt.entry is None:
                reg.set_state(rt, ModelState.BUILDING, "building in the background")
            else:
                reg.set_state(rt, rt.state, rt.reason)  # tell the listeners the model changed
        for _, new in txn.swapped:
            reg.set_state(new, new.state, new.reason)
        return retired


def _cannot_serve(rt: ModelRuntime, e: EdgedError) -> EdgedError:
    return EdgedError(f"{rt.name}: {rt.cfg.path} cannot be served: {e.message}")


def _restart_only(server: ServerConfig) -> ServerConfig:
    return msgspec.structs.replace(server, model_repository="")


def _repository_paths(cfg: Config) -> list[str]:
    """What a change to the model repository shows in: the repository's folder (a model added or
    removed) and its edged.toml, each model's folder (a version added or removed), config.pbtxt
    and each served version's folder (a file replaced there, such as a model.plan)."""
    if not cfg.server.model_repository:
        return []
    root = cfg.server.model_repository
    paths = {root, os.path.join(root, "edged.toml")}
    for origin in cfg.repository.values():
        paths |= {origin.folder, os.path.join(origin.folder, "config.pbtxt")}
        paths.add(os.path.join(origin.folder, origin.version))
    return sorted(paths)


def _stamp(path: str) -> tuple[int, int]:
    try:
        st = os.stat(path)
    except OSError:
        return (0, 0)
    return (st.st_mtime_ns, st.st_ino)
