"""The daemon's side of builds: one at a time, each in a child process, within memory headroom.

A child that crashes, is killed or runs out of memory fails only its own model; the runner reports
why and the daemon keeps serving. Progress events from the child feed the status endpoint and
systemd's STATUS= line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edged.config import BuildConfig, format_size, parse_size
from edged.errors import BuildError
from edged.host.memory import MemoryInfo
from edged.quantize.job import BuildJob

log = logging.getLogger(__name__)

OnProgress = Callable[[str, float | None], None]


@dataclass
class BuildStatus:
    model: str
    phase: str = "queued"
    fraction: float | None = None
    started: float = field(default_factory=time.monotonic)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "phase": self.phase,
            "fraction": self.fraction,
            "seconds": round(time.monotonic() - self.started, 1),
        }


class BuildRunner:
    def __init__(self, cfg: BuildConfig, memory: Callable[[], MemoryInfo]) -> None:
        self.cfg = cfg
        self._memory = memory
        self._lock = asyncio.Lock()
        self.active: dict[str, BuildStatus] = {}
        self._procs: set[asyncio.subprocess.Process] = set()

    async def build(self, job: BuildJob, on_progress: OnProgress | None = None) -> dict[str, Any]:
        """Run the job in a child; return its ``done`` event. Raises BuildError with the reason."""
        status = BuildStatus(job.model)
        self.active[job.model] = status
        try:
            async with self._lock:
                await self._wait_for_headroom(job.model, status)
                return await self._run_child(job, status, on_progress)
        finally:
            self.active.pop(job.model, None)

    async def _wait_for_headroom(self, model: str, status: BuildStatus) -> None:
        need = parse_size(self.cfg.headroom)
        deadline = time.monotonic() + self.cfg.wait_for_memory_s
        while True:
            # A probe can block (jtop takes about a second): never on the event loop.
            free = (await asyncio.to_thread(self._memory)).available
            if free >= need:
                return
            if time.monotonic() >= deadline:
                raise BuildError(
                    f"build of '{model}' needs {format_size(need)} free (build.headroom), "
                    f"only {format_size(free)} is available"
                )
            status.phase = f"waiting for memory ({format_size(free)} of {format_size(need)} free)"
            await asyncio.sleep(1.0)

    async def _run_child(self, job: BuildJob, status: BuildStatus, on_progress: OnProgress | None) -> dict[str, Any]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "edged.quantize.worker",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        self._procs.add(proc)
        assert proc.stdin and proc.stdout and proc.stderr
        try:
            proc.stdin.write(json.dumps(job.to_dict()).encode())
            proc.stdin.close()
        except (OSError, RuntimeError):
            # The child died before it read its job (killed at once, say): its exit status,
            # read below, says how; a closed pipe is not the daemon's error.
            pass
        stderr_task = asyncio.ensure_future(proc.stderr.read())
        events: dict[str, Any] = {}
        try:
            rc = await asyncio.wait_for(self._pump(proc, status, on_progress, events), self.cfg.timeout_s)
        except asyncio.TimeoutError:
            # A timeout fails this model's build only; it must never reach the daemon's loop.
            await self._kill(proc, stderr_task)
            raise BuildError(
                f"build of '{job.model}' took longer than build.timeout_s ({self.cfg.timeout_s} s); stopped"
            ) from None
        except asyncio.CancelledError:
            await self._kill(proc, stderr_task)
            raise
        finally:
            self._procs.discard(proc)
        result, error = events.get("done"), events.get("error", "")
        tail = (await stderr_task).decode(errors="replace").strip().splitlines()[-5:]
        if rc == 0 and isinstance(result, dict):
            return result
        raise BuildError(self._explain(job.model, rc, error, tail))

    @staticmethod
    async def _kill(proc: asyncio.subprocess.Process, stderr_task: asyncio.Future[bytes]) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        stderr_task.cancel()

    @staticmethod
    async def _pump(
        proc: asyncio.subprocess.Process, status: BuildStatus, on_progress: OnProgress | None, events: dict[str, Any]
    ) -> int:
        assert proc.stdout is not None
        async for line in proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            kind = event.get("event")
            if kind == "progress":
                status.phase, status.fraction = event["phase"], event.get("fraction")
                if on_progress:
                    on_progress(status.phase, status.fraction)
            elif kind == "done":
                events["done"] = event
            elif kind == "error":
                events["error"] = event.get("message", "")
        return await proc.wait()

    @staticmethod
    def _explain(model: str, rc: int, error: str, tail: list[str]) -> str:
        if rc < 0:
            sig = signal.Signals(-rc).name
            why = "killed (out of memory?)" if sig == "SIGKILL" else f"died of {sig}"
            return f"build of '{model}' {why}"
        return f"build of '{model}' failed: {error or ' | '.join(tail) or f'exit code {rc}'}"

    def kill_all(self) -> None:
        for proc in list(self._procs):
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
