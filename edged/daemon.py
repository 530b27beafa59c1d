"""The lifecycle and composition root: the fixed start order, signals, drain and stop.

Start: config → memory probe and budget → cache → socket bound (requests wait for readiness) →
resolve every model → plan → build what is missing → load and warm the admitted boot models →
warm the request path → READY=1. Stop: STOPPING=1 → stop accepting → drain → unload → remove
the socket. A second SIGTERM forces the exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import uvicorn

from edged import systemd
from edged.build.runner import BuildRunner
from edged.cache import EngineCache
from edged.config import Config, format_size, max_body_bytes
from edged.errors import CacheError, EdgedError, SocketInUseError
from edged.memory import MemoryInfo, budget_bytes, plan, probe
from edged.metrics import Metrics
from edged.registry import DEFERRED, FAILED, LAZY, READY, ModelRuntime, Registry
from edged.reload import Reloader
from edged.service import Service
from edged.transports.http import App
from edged.transports.shm import SharedMemoryRegistry
from edged.warmpath import warm_request_path

log = logging.getLogger(__name__)

EXTEND_USEC = 90_000_000  # each progress event buys a slow build another 90 s of start timeout


def isolate_library_files(cfg: Config) -> None:
    """ONNX Runtime writes a device id and an events database under $XDG_CACHE_HOME on import:
    keep those under the daemon's own cache directory instead of a home directory."""
    os.environ["XDG_CACHE_HOME"] = str(Path(cfg.cache.dir) / ".lib")


def bind_socket(path: str, mode: int, group: str = "") -> socket.socket:
    """Bind the Unix socket: replace a stale file from a crashed run, never steal a live one."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.exists() or p.is_symlink():
        probe_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe_sock.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            log.info("removing stale socket %s", path)
            p.unlink(missing_ok=True)
        except OSError as e:
            raise SocketInUseError(f"{path} exists and is not a usable socket: {e}") from None
        else:
            raise SocketInUseError(f"another edged is already serving on {path}; refusing to start")
        finally:
            probe_sock.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o777 & ~mode)  # the file is never visible with looser permissions
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, mode)
    if group:
        import grp

        os.chown(path, -1, grp.getgrnam(group).gr_gid)
    sock.listen(256)
    sock.setblocking(False)
    return sock


class Daemon:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.metrics = Metrics()
        self.cache = EngineCache(cfg.cache.dir)
        self.stop_event = asyncio.Event()
        self.exit_code = 0
        self._signals = 0
        self._owned_socket: str | None = None
        self.server: uvicorn.Server | None = None
        self.service: Service | None = None
        self.registry: Registry | None = None
        self.shm = SharedMemoryRegistry()
        self.memory: MemoryInfo | None = None
        self.mqtt: Any = None  # edged.transports.mqtt.MqttTransport when [mqtt] enabled
        self.reloader: Reloader | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    # --- start ---

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self._install_signals(loop)
        start = loop.create_task(self._start(loop))
        stop = loop.create_task(self.stop_event.wait())
        # A stop asked for while models build or warm interrupts the start-up.
        await asyncio.wait({start, stop}, return_when=asyncio.FIRST_COMPLETED)
        if not start.done():
            log.info("stopping during start-up")
            start.cancel()
        try:
            await start
        except asyncio.CancelledError:
            pass
        except EdgedError as e:
            log.error("cannot start: %s", e.message)
            systemd.status(f"failed: {e.message}")
            stop.cancel()
            await self._stop()
            return 1
        await stop
        await self._stop()
        return self.exit_code

    async def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        cfg = self.cfg
        systemd.status("starting: probing memory")
        self.memory = probe(cfg.memory.probe)
        budget = budget_bytes(cfg.memory, self.memory)
        log.info(
            "memory from %s: %s total, %s available, budget %s%s",
            self.memory.source,
            format_size(self.memory.total),
            format_size(self.memory.available),
            format_size(budget),
            f" ({self.memory.detail})" if self.memory.detail else "",
        )
        self.metrics.budget.set(budget)
        self.cache.prepare()
        runner = BuildRunner(cfg.build, lambda: probe(cfg.memory.probe))
        self.registry = Registry(cfg, self.cache, runner, self.metrics, budget, self._on_state)
        self.metrics.watch(self._queue_depths, ("http", "mqtt") if cfg.mqtt.enabled else ("http",))
        self.service = Service(self.registry, self.metrics, loop, self.memory, plan([], budget))
        app = App(self.service, self.shm, max_body_bytes(cfg))
        await self._serve(app)
        if cfg.mqtt.enabled:
            # Imported only when enabled: transports never load what the config does not use.
            from edged.transports.mqtt import MqttTransport

            self.mqtt = MqttTransport(cfg.mqtt, self.service, loop)
            await self.mqtt.start()
        await self._boot_models(loop)
        self.service.warming = True
        try:
            await warm_request_path(app, self.registry)
        finally:
            self.service.warming = False
        self.service.status_line = self._summary()
        self.service.ready.set()
        systemd.ready(self.service.status_line)
        log.info("ready: %s", self.service.status_line)
        self.reloader = Reloader(self.registry, loop, self._summary, self._set_status)
        self._spawn(self._watchdog())
        if cfg.lifecycle.watch_files:
            self._spawn(self.reloader.watch(self.stop_event))
        loop.add_signal_handler(signal.SIGHUP, self._on_reload_signal)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _set_status(self, text: str) -> None:
        if self.service is not None:
            self.service.status_line = text
        systemd.status(text)

    def _on_reload_signal(self) -> None:
        if self.reloader is not None and not self.stop_event.is_set():
            self._spawn(self.reloader.reload())

    async def _serve(self, app: App) -> None:
        from edged.transports import listener

        listeners = listener.listeners_from(self.cfg, bind_socket)
        self._owned_socket = next((x.owned_path for x in listeners if x.owned_path), None)
        self.app = app
        self.server = await listener.start(app, self.cfg, listeners)

    async def _boot_models(self, loop: asyncio.AbstractEventLoop) -> None:
        reg = self.registry
        assert reg is not None and self.service is not None
        for rt in reg.models.values():
            try:
                reg.resolve(rt)
            except EdgedError as e:
                reg.set_state(rt, FAILED, e.message)
        candidates = [rt for rt in reg.models.values() if rt.state != FAILED]
        self.service.plan = the_plan = plan([rt.plan_item() for rt in candidates], reg.budget)
        for name, why in the_plan.deferred.items():
            reg.set_state(reg.models[name], DEFERRED, why)
        missing = [rt for rt in candidates if rt.entry is None]
        for i, rt in enumerate(missing, 1):
            await self._build(rt, i, len(missing))
        for name in the_plan.admitted:
            rt = reg.models[name]
            if rt.entry is None:
                continue
            systemd.status(f"loading {name}")
            await self._load_or_rebuild(rt, loop)
        for name in the_plan.lazy:
            if reg.models[name].entry is not None:
                reg.set_state(reg.models[name], LAZY, "loads on first request")
        reg.digests.save()

    async def _load_or_rebuild(self, rt: ModelRuntime, loop: asyncio.AbstractEventLoop) -> None:
        """An engine that checked out but will not load (another TensorRT, a corrupt plan) has
        been moved aside by the registry: build it again once, then load that."""
        assert self.registry is not None
        try:
            await self.registry.load(rt, loop)
            return
        except CacheError as e:
            log.warning("%s: %s; rebuilding", rt.name, e.message, extra={"model": rt.name})
        except EdgedError as e:
            self.registry.set_state(rt, FAILED, e.message)
            return
        await self._build(rt, 1, 1)
        if rt.entry is None:
            return
        try:
            await self.registry.load(rt, loop)
        except EdgedError as e:
            self.registry.set_state(rt, FAILED, e.message)

    async def _build(self, rt: ModelRuntime, index: int, total: int) -> None:
        assert self.registry is not None
        label = f"building {rt.name} {rt.precision} ({index}/{total})"
        systemd.status(label)
        systemd.extend_timeout(EXTEND_USEC)

        def progress(phase: str, fraction: float | None) -> None:
            pct = f" {fraction * 100:.0f}%" if fraction is not None else ""
            systemd.status(f"{label}: {phase}{pct}")
            systemd.extend_timeout(EXTEND_USEC)

        try:
            await self.registry.build(rt, progress)
        except EdgedError as e:
            self.registry.set_state(rt, FAILED, e.message)
            log.error("%s: %s", rt.name, e.message, extra={"model": rt.name})
        else:
            if rt.state not in (DEFERRED, FAILED):
                self.registry.set_state(rt, "built")

    def _summary(self) -> str:
        assert self.registry is not None
        states = [rt.state for rt in self.registry.models.values()]
        parts = [f"{states.count(READY)} models ready"]
        for state in (LAZY, DEFERRED, FAILED):
            n = states.count(state)
            if n:
                reasons = {rt.reason.split(":")[0] for rt in self.registry.models.values() if rt.state == state}
                parts.append(f"{n} {state}" + (f": {', '.join(sorted(reasons))}" if state != LAZY else ""))
        return ", ".join(parts)

    def _queue_depths(self) -> dict[str, int]:
        """Read by /metrics at scrape time: every configured model, with its requests in flight."""
        assert self.registry is not None
        # list(): /metrics renders off the loop, and a reload may add a model meanwhile.
        return {n: rt.queue.pending if rt.queue else 0 for n, rt in list(self.registry.models.items())}

    def _on_state(self, rt: ModelRuntime) -> None:
        if self.mqtt is not None:
            self.mqtt.model_state(rt)

    # --- watchdog ---

    async def _watchdog(self) -> None:
        interval = systemd.watchdog_interval()
        if not interval:
            return
        stall = self.cfg.lifecycle.stall_timeout_s
        while not self.stop_event.is_set():
            self._apply_test_faults()
            if self._healthy(stall):
                systemd.watchdog_ping()
            else:
                log.error("an inference worker is stuck for over %.0f s; withholding watchdog pings", stall)
            await asyncio.sleep(interval / 2)

    def _apply_test_faults(self) -> None:
        """Test-only fault switch: while the file named by $EDGED_TEST_WEDGE exists, every worker
        that takes a request hangs on it, as a wedged GPU call would."""
        path = os.environ.get("EDGED_TEST_WEDGE")
        if not path or self.registry is None:
            return
        wedge = os.path.exists(path)
        for rt in self.registry.models.values():
            if rt.queue is not None:
                (rt.queue.fault_wedge.set if wedge else rt.queue.fault_wedge.clear)()

    def _healthy(self, stall: float) -> bool:
        assert self.registry is not None
        return all(rt.queue is None or rt.queue.healthy(stall) for rt in self.registry.models.values())

    # --- signals and stop ---

    def _install_signals(self, loop: asyncio.AbstractEventLoop) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_stop_signal, sig)

    def _on_stop_signal(self, sig: int) -> None:
        self._signals += 1
        if self._signals > 1:
            log.warning("second %s: exiting now", signal.Signals(sig).name)
            if self._owned_socket:
                with contextlib.suppress(OSError):
                    os.unlink(self._owned_socket)
            os._exit(1)
        log.info("%s: stopping", signal.Signals(sig).name)
        self.stop_event.set()

    async def _stop(self) -> None:
        systemd.stopping("draining requests")
        started = time.monotonic()
        for task in list(self._tasks):
            task.cancel()
        if self.service is not None:
            self.service.stopping = True
        if self.server is not None:
            self.app.accepting = False
        if self.registry is not None:
            self.registry.runner.kill_all()
        if self.server is not None:
            self.server.should_exit = True
            await self.server.shutdown()
        if self.mqtt is not None:
            await self.mqtt.stop()
        if self.registry is not None:
            for rt in self.registry.models.values():
                if rt.backend is not None:
                    await self.registry.unload(rt, "unloaded", "daemon stopping")
        self.shm.unregister()
        if self._owned_socket:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._owned_socket)
        log.info("stopped in %.2f s", time.monotonic() - started)


def serve(cfg: Config) -> int:
    isolate_library_files(cfg)
    systemd.setup_logging(cfg.server.log_level)
    daemon = Daemon(cfg)
    try:
        import uvloop

        return uvloop.run(daemon.run())
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(daemon.run())
