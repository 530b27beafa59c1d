"""Repository loads that carry a configuration, and files (Triton's model repository extension,
tritonclient's ``load_model(name, config=..., files=...)``).

A load with a ``config`` serves the model with that configuration in place of its config.pbtxt;
``file:`` entries take the place of its folder too (or make a model the repository lacks). That
lasts until a load without a config puts the repository's back, or the daemon restarts (nothing
of it is kept, as in Triton). edged.toml's table for the model still applies.

It is applied as a reload with the model translated from the request's configuration, so the
reload's stand-ins, background build and held swap do the work, and everything else stays as it
was. The load answers once the new configuration serves. If it cannot (a refused field, a build
that fails), the load fails saying why, the request's configuration is dropped and what served
before serves on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from edged.config import NAME_RE, Config
from edged.errors import BadRequestError, ConfigError, EdgedError, ForbiddenError, ModelNotFoundError
from edged.lifecycle.reload import Reloader
from edged.repository import overrides, uploads
from edged.repository.load import read_model
from edged.repository.load_request import LoadRequest, parse_config
from edged.repository.translate import Given, Override
from edged.serving.background import BackgroundBuilds
from edged.serving.registry import Registry

log = logging.getLogger(__name__)


class ModelLoads:
    def __init__(self, reloader: Reloader, background: BackgroundBuilds, registry: Registry, cfg: Config) -> None:
        self.reloader = reloader
        self.background = background
        self.registry = registry
        self.max_uploads = cfg.server.model_uploads  # read once: [server] changes at a restart
        self.area = Path(cfg.cache.dir) / uploads.AREA
        self._lock = asyncio.Lock()  # one configured load at a time: each is a reload

    async def load(self, name: str, request: LoadRequest) -> None:
        """Apply a load request's configuration, or (a load without one) put the repository's
        back; the caller then loads the model's versions as for any load. A model the repository
        lacks keeps its uploaded files through a load without a config."""
        if not request.given:
            over = self.reloader.replaced.get(name)
            if over is not None and (not over.uploaded or self._in_repository(name)):
                await _finished(self._drop(name))
            return
        if not NAME_RE.match(name):  # before the name goes near a path
            raise BadRequestError(
                f"failed to load '{name[:80]}': a model's name is 1-64 of [A-Za-z0-9_.-], starting alnum"
            )
        self._check(name, request)
        await _finished(self._configure(name, request))

    async def unload(self, name: str) -> bool:
        """An unload of a model that serves uploaded files and that the repository lacks drops
        the files and the model (as in Triton, and so that they stop counting against
        server.model_uploads): True. Any other model is unloaded as usual, its configuration
        kept for the next load."""
        over = self.reloader.replaced.get(name)
        if over is None or not over.uploaded or self._in_repository(name):
            return False
        await _finished(self._drop(name))
        return True

    async def _drop(self, name: str) -> None:
        async with self._lock:
            if name in self.reloader.replaced:
                await self._apply(name, None)

    async def _configure(self, name: str, request: LoadRequest) -> None:
        async with self._lock:
            self._check_room(name, request)
            over = await asyncio.to_thread(self._prepare, name, request)
            try:
                await self._apply(name, over)
            except BaseException:
                if over.uploaded and self.reloader.replaced.get(name) is not over:
                    await asyncio.to_thread(uploads.remove, over.folder)
                raise

    def _in_repository(self, name: str) -> bool:
        root = self.registry.cfg.server.model_repository
        return bool(root) and (Path(root) / name).is_dir()

    def _check(self, name: str, request: LoadRequest) -> None:
        if request.files and self.max_uploads == 0:
            raise ForbiddenError(
                f"failed to load '{name}': a load's files are refused here ([server] model_uploads = 0); "
                "put the model in the repository, or give a config alone"
            )
        cfg = self.registry.cfg
        if not cfg.server.model_repository:
            raise BadRequestError(
                f"failed to load '{name}': a config in a load request configures a model of the model "
                "repository, and edged serves none ([server] model_repository)"
            )
        if name in cfg.models and name not in {o.model for o in cfg.repository.values()}:
            raise BadRequestError(
                f"failed to load '{name}': it is the config file's [models.{name}], configured there; "
                "a config in a load request configures a model of the model repository"
            )

    def _check_room(self, name: str, request: LoadRequest) -> None:
        held = {n for n, o in self.reloader.replaced.items() if o.uploaded} - {name}
        if request.files and len(held) >= self.max_uploads:
            raise ForbiddenError(
                f"failed to load '{name}': {len(held)} models already serve uploaded files, "
                f"server.model_uploads = {self.max_uploads}; unload one of them first"
            )

    def _prepare(self, name: str, request: LoadRequest) -> Override:
        """The request as an Override, its files placed and the model translated from it (in a
        thread: JSON, files and model graphs are read)."""
        assert request.config is not None
        root = Path(self.registry.cfg.server.model_repository)
        given = Given(name, parse_config(name, request.config), f"the load request's config of '{name}'")
        if not request.files:
            folder = root / name
            if not folder.is_dir():
                raise ModelNotFoundError(f"failed to load '{name}': the model repository {root} has no model '{name}'")
            return self._translated(root, name, Override(given, folder, uploaded=False))
        over = Override(given, uploads.place(self.area, name, request.files), uploaded=True)
        try:
            return self._translated(root, name, over)
        except BaseException:
            uploads.remove(over.folder)
            raise

    @staticmethod
    def _translated(root: Path, name: str, over: Override) -> Override:
        """``over`` once the model translates from it; an uploaded ONNX model it serves keeps its
        external data among the uploaded files."""
        try:
            served = read_model(root, name, None, overrides.read(root).get(name), over=over)
        except ConfigError as e:
            raise BadRequestError(f"failed to load '{name}': {e.message}") from None
        if over.uploaded:
            for _, model, _ in served:
                if model.backend != "llama":  # an ONNX model (engines are never uploaded)
                    uploads.check_external_data(over.folder, Path(model.path), name)
        return over

    async def _apply(self, name: str, over: Override | None) -> None:
        """Serve ``name`` from ``over`` (None: from its repository folder, or not at all when the
        repository lacks it); on any failure what served before serves on, its override back."""
        previous = self.reloader.replaced.get(name)
        self._set(name, over)
        try:
            why = "" if await self.reloader.reload() else self.reloader.last_error
            if not why:
                why = await self._settle(name)
                if why:  # the new configuration does not serve: back to what did
                    self._set(name, previous)
                    await self.reloader.reload()
        except BaseException:
            self._set(name, previous)
            raise
        if why:
            self._set(name, previous)
            raise EdgedError(f"failed to load '{name}': {why}")
        if previous is not None and previous.uploaded and previous is not over:
            await asyncio.to_thread(uploads.remove, previous.folder)
        log.info("%s: serving %s", name, "the load request's config" if over else "its repository config")

    def _set(self, name: str, over: Override | None) -> None:
        if over is None:
            self.reloader.replaced.pop(name, None)
        else:
            self.reloader.replaced[name] = over

    async def _settle(self, name: str) -> str:
        """Wait for the model's versions that build; why one does not serve, or ""."""
        cfg = self.registry.cfg
        for served in [s for s, o in cfg.repository.items() if o.model == name]:
            if self.background.target(served) is None:
                continue
            why = await self.background.settled(served, cfg.models[served], cfg.build.timeout_s + 300)
            if why:
                return f"{served}: {why}"
        return ""


async def _finished(work: Coroutine[Any, Any, None]) -> None:
    """``work`` run to its end even when the request that asked for it is cancelled (a deadline,
    a client gone): a reload or an upload half done would leave the override and the files out
    of step. Its outcome, when nobody waits for it any more, is logged."""
    task = asyncio.get_running_loop().create_task(work)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        if not task.done() or not task.cancelled():
            task.add_done_callback(_logged)
        raise


def _logged(task: asyncio.Task[None]) -> None:
    if task.cancelled():
        return
    e = task.exception()
    if e is None:
        log.info("a configured load finished after its request was cancelled")
    else:
        log.warning("a configured load failed after its request was cancelled: %s", e)
