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
from pathlib import Path

from edged.config import Config
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
            if name in self.reloader.replaced and self._in_repository(name):
                async with self._lock:
                    await self._apply(name, None)
            return
        self._check(name, request)
        async with self._lock:
            self._check_room(name, request)
            over = await asyncio.to_thread(self._prepare, name, request)
            try:
                await self._apply(name, over)
            except BaseException:
                if over.uploaded:
                    await asyncio.to_thread(uploads.remove, over.folder)
                raise

    async def unload(self, name: str) -> bool:
        """An unload of a model that serves uploaded files drops them (as in Triton, and so that
        they stop counting against server.model_uploads): a model the repository lacks is gone,
        True; one it has comes back to its config.pbtxt, for the caller to unload."""
        over = self.reloader.replaced.get(name)
        if over is None or not over.uploaded:
            return False
        async with self._lock:
            await self._apply(name, None)
        return not self._in_repository(name)

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
                f"server.model_uploads = {self.max_uploads}; load one of them without a config first"
            )

    def _prepare(self, name: str, request: LoadRequest) -> Override:
        """The request as an Override, its files placed and the model translated from it (in a
        thread: JSON, files and model graphs are read)."""
        assert request.config is not None
        root = Path(self.registry.cfg.server.model_repository)
        given = Given(name, parse_config(name, request.config), f"the load request's config of '{name}'")
        if request.files:
            over = Override(given, uploads.place(self.area, name, request.files), uploaded=True)
        else:
            folder = root / name
            if not folder.is_dir():
                raise ModelNotFoundError(f"failed to load '{name}': the model repository {root} has no model '{name}'")
            over = Override(given, folder, uploaded=False)
        try:
            read_model(root, name, None, overrides.read(root).get(name), over=over)
        except ConfigError as e:
            if over.uploaded:
                uploads.remove(over.folder)
            raise BadRequestError(f"failed to load '{name}': {e.message}") from None
        return over

    async def _apply(self, name: str, over: Override | None) -> None:
        replaced = self.reloader.replaced
        previous = replaced.get(name)
        self._set(name, over)
        why = "" if await self.reloader.reload() else self.reloader.last_error
        if not why:
            why = await self._settle(name)
            if why:  # the new configuration does not serve: back to what did
                self._set(name, previous)
                await self.reloader.reload()
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
