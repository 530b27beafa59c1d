"""Models that wait for their backend's library, and join the running daemon once it imports.

A backend whose library may be installed after the daemon started (``edged.backends.LATE_LIBRARIES``:
llama-cpp-python compiles llama.cpp for minutes) leaves its models ``waiting`` instead of failed,
and the other models serve meanwhile. Every ``RECHECK_S`` a worker thread (never the event loop:
it lists directories) drops the import system's caches and looks for the library. pip writes a
package file by file, so a library that appeared is imported only once its files stayed the same
for one interval, and an import that failed is tried again only once they change. When it imports,
the model is resolved like any other and handed to the background builds, which build, load and
warm it while the waiting runtime stays registered, then swap it in: until then its requests get
503 ``model_not_ready`` with the step under way in the reason, and readiness does not move (a
waiting model has settled, edged/serving/states.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from edged import backends
from edged.errors import BackendUnavailableError, EdgedError
from edged.serving.registry import ModelRuntime, Registry
from edged.serving.states import ModelState

log = logging.getLogger(__name__)

# How often a waiting model's library is looked for. A look lists the library's directory (tens
# of files for llama_cpp) and the sys.path directories: well under a millisecond of a core; the
# model joins at most two intervals after its install ended.
RECHECK_S = 2.0


@dataclass
class _Seen:
    files: backends.Files | None = None  # what the last look found
    failed: backends.Files | None = None  # the files of the last import that failed
    error: str = ""  # what that import said


class BackendWaits:
    """Looks for the libraries that registered ``waiting`` models need; hands a model whose
    backend imports to ``submit(target, load)`` as a new runtime to build and swap in."""

    def __init__(
        self,
        registry: Registry,
        loop: asyncio.AbstractEventLoop,
        submit: Callable[[ModelRuntime, bool], None],
        busy: Callable[[str], bool],
        on_change: Callable[[], None],
    ) -> None:
        self.registry = registry
        self.loop = loop
        self._submit = submit
        self._busy = busy  # a model already handed over (its build or load under way)
        self._on_change = on_change
        self._seen: dict[str, _Seen] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = self.loop.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def waiting(self) -> list[ModelRuntime]:
        return [
            rt
            for rt in self.registry.models.values()
            if rt.state == ModelState.WAITING and rt.waits_for and rt.backend_cls is None and not self._busy(rt.name)
        ]

    async def _run(self) -> None:
        while True:
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception:  # at the task's boundary: logged, and the next look tries again
                log.exception("looking for a waiting model's backend failed")
            await asyncio.sleep(RECHECK_S)  # the interval between two looks, not a wait for an event

    async def check(self) -> None:
        """One look at every library a waiting model needs; the models whose backend imports join."""
        models = self.waiting()
        for backend in sorted({rt.waits_for for rt in models}):
            why = await asyncio.to_thread(self._look, backend)
            for rt in models:
                if rt.waits_for != backend or self.registry.models.get(rt.name) is not rt:
                    continue
                if why:
                    self._say(rt, why)
                else:
                    await self._join(rt)

    def _look(self, backend: str) -> str:
        """'' when the backend imports now; otherwise why the model still waits. Blocking."""
        module, _ = backends.LATE_LIBRARIES[backend]
        seen = self._seen.setdefault(backend, _Seen())
        files = backends.library_files(module)
        previous, seen.files = seen.files, files
        if files is None:
            return backends.not_installed_text(backend)
        if files != previous:
            return f"backend {backend} is being installed: {module} found, waiting for its files to settle"
        if files == seen.failed:
            return seen.error
        try:
            backends.backend_class(backend)
        except BackendUnavailableError as e:  # a known backend: its import failed
            seen.failed, seen.error = files, f"{e.message}; tried again when its files change"
            log.warning("%s", seen.error)
            return seen.error
        log.info("backend %s imports now", backend)
        return ""

    def _say(self, rt: ModelRuntime, why: str) -> None:
        if rt.reason != why:  # logged and published once per change
            self.registry.set_state(rt, ModelState.WAITING, why)
            self._on_change()

    async def _join(self, rt: ModelRuntime) -> None:
        """Resolve a fresh runtime for ``rt``'s model (hashing the file: in a thread) and hand it
        over; ``rt`` stays registered, waiting, until what replaces it serves."""
        reg = self.registry
        self._say(rt, f"backend {rt.waits_for} imports; resolving")
        target = ModelRuntime(rt.name, rt.cfg)
        try:
            await asyncio.to_thread(reg.resolve, target)
        except EdgedError as e:
            if reg.models.get(rt.name) is rt:
                reg.set_state(rt, ModelState.FAILED, e.message)
                self._on_change()
            return
        if reg.models.get(rt.name) is not rt or self._busy(rt.name):
            return  # a reload replaced it, or handed it over, meanwhile
        if target.waits_for:  # its files changed between the import and the resolve: look again
            self._say(rt, target.backend_reason)
            return
        self._submit(target, rt.cfg.preload == "boot")
