"""One model's attempt at one desired version: download → verify → build and gate → swap →
watch, and the rollback when a step says no. Every blocking step runs in a worker thread; the
model's current version serves until the swap (the reload's held swap), and serves again if the
new one is rolled back (its folder is kept until a later version has served).

Outcomes: "serving" (or "watching", then "serving"), "refused" (the bundle or the desired version
will not be used: blocked until the desired state changes), "rolled back" (it was applied and
went back: blocked likewise), "retry" (a download that broke off: tried again later, resumed).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
from packaging.version import Version

from edged.config import ModelConfig
from edged.fleet import download, rollback
from edged.fleet.desired import Target
from edged.fleet.ledger import Installed, ModelRecord

if TYPE_CHECKING:
    from edged.fleet.bundle import Bundle, BundleRefused
    from edged.fleet.context import Agent

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 1.0
# Download failures that no retry mends, and the refusal code each is counted under.
FATAL_DOWNLOADS = {"digest": "digest_mismatch", "too_large": "too_large", "not_found": "not_found"}


class Attempt:
    def __init__(self, agent: Agent, name: str, target: Target) -> None:
        self.agent = agent
        self.name = name
        self.t = target
        self.cancel = threading.Event()
        self.rec: ModelRecord = agent.book.record(name)
        self._last_progress = 0.0

    async def run(self) -> str:
        from edged.fleet.bundle import BundleRefused

        rec, t = self.rec, self.t
        rec.target, rec.target_key, rec.gate, rec.build_s = t.version, t.key, None, None
        floor = rec.floor
        if floor and Version(t.version) <= Version(floor):  # anti-rollback, before any download
            why = f"version {t.version} is not newer than {floor}, the newest that served here (replayed older bundle)"
            return self.refuse(BundleRefused(why, "version_replayed"))
        self.agent.set_phase(self.name, "downloading")
        limits = download.Limits(self.agent.max_bundle_bytes, self.agent.fleet.download_timeout_s)
        try:
            archive = await asyncio.to_thread(download.fetch, t, self.agent.area, limits, self.cancel, self._progress)
        except download.Cancelled:
            return "superseded"
        except download.DownloadError as e:
            if e.code in FATAL_DOWNLOADS:
                return self.refuse(BundleRefused(f"download: {e.reason}", FATAL_DOWNLOADS[e.code]))
            # Not settled: the partial file stays and the worker resumes it later.
            self.agent.set_phase(self.name, "downloading", f"broke off: {e.reason}; trying again")
            return "retry"
        self.agent.set_phase(self.name, "verifying")
        try:
            bundle = await asyncio.to_thread(self._open, archive)
        except BundleRefused as e:
            return self.refuse(e)
        installed = Installed(
            t.version, t.sha256, str(bundle.root), msgspec.to_builtins(bundle.model_config), bundle.signer or ""
        )
        return await self._apply(installed, bundle.model_config)

    # --- checks ---------------------------------------------------------------------------------

    def _open(self, archive: Path) -> Bundle:
        """Blocking: unpack and verify; BundleRefused when the bundle is not the one to use."""
        from edged.fleet.bundle import BundleRefused

        dest = download.bundle_dir(self.agent.area, self.name, self.t)
        shutil.rmtree(dest, ignore_errors=True)  # unpacked afresh: only what was just verified is used
        try:
            bundle = self.agent.verify(archive, dest)
            if bundle.version != self.t.version:
                why = f"the bundle is signed as version {bundle.version}, the desired state says {self.t.version}"
                raise BundleRefused(why, "version_mismatch")
            if bundle.name != self.name:
                why = f"the bundle is model {bundle.name!r}, the desired state names it {self.name!r}"
                raise BundleRefused(why, "metadata_invalid")
        except BundleRefused:
            self._discard(archive, dest)
            raise
        return bundle

    @staticmethod
    def _discard(archive: Path, dest: Path) -> None:
        """A refused bundle leaves nothing behind to build from."""
        shutil.rmtree(dest, ignore_errors=True)
        archive.unlink(missing_ok=True)

    def _progress(self, done: int, expected: int) -> None:
        """From the download thread: at most one state report a second."""
        now = time.monotonic()
        if now - self._last_progress >= PROGRESS_EVERY_S:
            self._last_progress = now
            text = f"{done} of {expected} bytes" if expected else f"{done} bytes"
            self.agent.from_thread(self.agent.set_phase, self.name, "downloading", text)

    # --- applying -------------------------------------------------------------------------------

    async def _apply(self, new: Installed, mc: ModelConfig) -> str:
        agent, rec = self.agent, self.rec
        old_current, old_previous = rec.current, rec.previous
        before = agent.window_since_swap(self.name)  # the current version's traffic
        agent.overlay[self.name] = mc
        agent.set_phase(self.name, "building")
        started = time.monotonic()
        done, why = await agent.reload_now()
        problem = await self._settle(mc) if done else f"did not load: {why}"
        rec.build_s = round(time.monotonic() - started, 2)
        rt = agent.registry.models.get(self.name)
        if problem is None and rt is not None:
            rec.gate = rt.gate
            problem = rollback.gate_failure(rt.cfg.precision, rt.precision, rt.gate)
        if problem is not None:
            return await self.roll_back(problem, old_current, old_previous)
        rec.current, rec.previous = new, old_current
        agent.swapped(self.name, before)
        if agent.fleet.watch_s > 0:
            agent.set_phase(self.name, "watching", f"the first {agent.fleet.watch_s:g} s of traffic decide")
            agent.spawn(Watch(self, old_current, old_previous).run())
            return "watching"
        self.succeeded()
        return "serving"

    async def _settle(self, mc: ModelConfig) -> str | None:
        """Wait for the build the reload started: None once the new version serves, else why not."""
        agent = self.agent
        assert agent.background is not None

        def gating() -> None:
            if self.rec.phase != "gating":
                agent.set_phase(self.name, "gating")

        return await agent.background.settled(self.name, mc, agent.cfg.build.timeout_s + 300, gating)

    def succeeded(self) -> None:
        rec = self.rec
        assert rec.current is not None
        rec.floor = rec.current.version
        keep = {i.sha256 for r in self.agent.book.models.values() for i in (r.current, r.previous) if i is not None}
        keep |= {t.sha256 for t in self.agent.wanted.values()}
        self.agent.spawn(asyncio.to_thread(download.prune, self.agent.area, keep))
        self.agent.set_phase(self.name, "serving")

    def refuse(self, err: BundleRefused) -> str:
        """Counted, reported as an event and in the status, and blocked until the desired state
        names another version."""
        why = f"{err.reason} ({err.code})"
        refusals = self.agent.refusals
        if refusals is not None:
            refusals.record(err, model=self.name, source=self.t.url, version=self.t.version)
        self.rec.block(self.t.key, why)
        self.agent.set_phase(self.name, "refused", why)
        return "refused"

    async def roll_back(self, why: str, current: Installed | None, previous: Installed | None) -> str:
        """Back to ``current`` (the config file's model when None), then blocked."""
        agent, rec = self.agent, self.rec
        if current is not None:
            agent.overlay[self.name] = msgspec.convert(current.model, ModelConfig)
        else:
            agent.overlay.pop(self.name, None)
        rec.current, rec.previous = current, previous
        rec.block(self.t.key, why)
        done, error = await agent.reload_now()
        if not done:  # the version before may not serve either: say so, never "rolled back"
            agent.set_phase(self.name, "failed", f"{why}; going back failed too: {error}")
            return "failed"
        agent.set_phase(self.name, "rolled back", why)
        return "rolled back"


class Watch:
    """The new version's first ``watch_s`` seconds of traffic against the previous version's."""

    def __init__(self, attempt: Attempt, current: Installed | None, previous: Installed | None) -> None:
        self.a = attempt
        self.old = (current, previous)

    async def run(self) -> None:
        a, agent = self.a, self.a.agent
        f = agent.fleet
        policy = rollback.Policy(f.watch_s, f.min_requests, f.max_error_rate_increase, f.max_p99_increase)
        before = agent.previous_windows.get(a.name)
        start = time.monotonic()
        while time.monotonic() - start < policy.watch_s:
            await asyncio.sleep(min(5.0, policy.watch_s / 10))
            want = agent.wanted.get(a.name)
            if want is None or want.key != a.t.key:
                break  # superseded: it served until now, the next version takes over
            why = rollback.traffic_verdict(before, agent.window_since_swap(a.name), policy)
            if why is not None:
                await a.roll_back(why, *self.old)
                return
        a.succeeded()
