"""The lifecycle and composition root: the fixed start order, signals, drain and stop.

Start: config → memory probe and budget → cache → socket bound (requests wait for readiness) →
resolve every model → plan → build what is missing → load and warm the admitted boot models →
warm the request path → READY=1. Stop: STOPPING=1 → stop accepting → drain → unload → remove
the socket. A second SIGTERM forces the exit.

Signals are handled from the first instruction (edged.lifecycle.early_signals) to the last; a failure at any
point of the start-up runs the stop path and exits 78 (EX_CONFIG, systemd does not restart) for a
configuration problem, 1 otherwise, with one line saying why.
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

from edged.cache.collect import collect
from edged.cache.store import EngineCache
from edged.config import Config, max_body_bytes, parse_size
from edged.errors import ConfigError, EdgedError
from edged.fleet.hook import fleet_agent
from edged.host import malloc, systemd
from edged.host.memory import MemoryInfo, budget_bytes, probe
from edged.lifecycle import early_signals
from edged.lifecycle.boot import Boot
from edged.lifecycle.faults import wedge_switch_from_env
from edged.lifecycle.grpc_serving import GrpcListeners
from edged.lifecycle.loopwatch import LoopWatch
from edged.lifecycle.memory_budget import log_budget, probe_memory
from edged.lifecycle.model_loads import ModelLoads
from edged.lifecycle.path_warmup import warm_request_path
from edged.lifecycle.readiness import summary, unready
from edged.lifecycle.reload import Reloader
from edged.lifecycle.unix_sockets import bind_socket
from edged.lifecycle.watchdog import watchdog
from edged.paths import isolate_library_files
from edged.quantize.runner import BuildRunner
from edged.repository import uploads
from edged.serving.admission import plan
from edged.serving.background import BackgroundBuilds
from edged.serving.metrics import Metrics
from edged.serving.registry import ModelRuntime, Registry
from edged.serving.service import Service
from edged.serving.states import ModelState
from edged.transports.http.app import App
from edged.transports.shm.memfd_socket import FdSocket
from edged.transports.shm.regions import SharedMemoryRegistry, ShmLimits

log = logging.getLogger(__name__)

EX_CONFIG = 78  # sysexits.h: the unit's RestartPreventExitStatus= stops a restart loop on it


class Daemon:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.metrics = Metrics()
        self.cache = EngineCache(cfg.cache.dir)
        self.stop_event = asyncio.Event()
        self.exit_code = 0
        self._signals = 0
        self._reload_asked = False
        self._owned_socket: str | None = None
        self.server: uvicorn.Server | None = None
        self.service: Service | None = None
        self.registry: Registry | None = None
        self.shm = SharedMemoryRegistry(ShmLimits.from_config(cfg.server))
        self.grpc = GrpcListeners()
        self.fd_socket: FdSocket | None = None
        self._api_sockets: list[str] = []
        self.memory: MemoryInfo | None = None
        self.mqtt: Any = None  # edged.transports.mqtt.transport.MqttTransport when [mqtt] enabled
        self.reloader: Reloader | None = None
        self._wedge = wedge_switch_from_env()  # tests' fault injection (edged/lifecycle/faults.py), else None
        self.background: BackgroundBuilds | None = None
        self.loopwatch = LoopWatch(cfg.lifecycle.loop_probe_ms, cfg.lifecycle.loop_stall_ms, self._loop_sample)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._gc_lock = asyncio.Lock()
        self.fleet: Any = None  # edged.fleet.agent.FleetAgent when [fleet] follow = true

    # --- start ---

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self._install_signals(loop)
        self.loopwatch.start(loop)
        start = loop.create_task(self._start(loop))
        stop = loop.create_task(self.stop_event.wait())
        # A stop asked for while models build or warm interrupts the start-up.
        await asyncio.wait({start, stop}, return_when=asyncio.FIRST_COMPLETED)
        if not start.done():
            log.info("stopping during start-up")
            start.cancel()
        code = await self._started(start)
        if code is not None:
            stop.cancel()
            await self._stop()
            return code
        await stop
        await self._stop()
        return self.exit_code

    async def _started(self, start: asyncio.Task[None]) -> int | None:
        """None when the start-up finished (or was stopped); the exit code when it failed."""
        try:
            await start
        except asyncio.CancelledError:
            return None
        except ConfigError as e:
            return self._cannot_start(e.message, EX_CONFIG)
        except EdgedError as e:
            return self._cannot_start(e.message, 1)
        except Exception as e:  # anything else: one clear line, the traceback only at debug level
            log.debug("start-up failed", exc_info=True)
            return self._cannot_start(f"{e.__class__.__name__}: {e}", 1)
        return None

    def _cannot_start(self, message: str, code: int) -> int:
        log.error("cannot start: %s", message)
        systemd.status(f"failed: {message}")
        return code

    async def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        cfg = self.cfg
        systemd.status("starting: probing memory")
        self.memory = await probe_memory(cfg.memory)
        budget = budget_bytes(cfg.memory, self.memory)
        log_budget(self.memory, budget)
        self.metrics.budget.set(budget)
        self.registry = await self._open_registry(budget)
        grpc = ("grpc",) if cfg.server.grpc_socket != "none" or cfg.server.grpc_tcp else ()
        self.metrics.watch(self._queue_depths, ("http", *grpc, *(("mqtt",) if cfg.mqtt.enabled else ())))
        self.background = BackgroundBuilds(self.registry, loop, self._refresh_status, self._after_swap)
        self.service = Service(self.registry, self.metrics, loop, self.memory, plan([], budget))
        self.service.unready = self._unready
        app = App(self.service, self.shm, max_body_bytes(cfg))
        await self._serve(app)
        if cfg.mqtt.enabled:
            # Imported only when enabled: transports never load what the config does not use.
            from edged.transports.mqtt.transport import MqttTransport

            self.mqtt = MqttTransport(cfg.mqtt, self.service, loop)
            await self.mqtt.start()
        boot = Boot(self.registry, self.background, loop)
        self.service.plan = await boot.boot()
        await self._warm_and_announce(app, self.service, self.registry)
        self.reloader = Reloader(self.registry, loop, self._summary, self._set_status, self.background)
        self.service.configured = ModelLoads(self.reloader, self.background, self.registry, cfg)
        boot.start_later()
        if self.fleet is not None:
            await self.fleet.start(self.service, self.background, self.reloader)
        self._spawn(watchdog(self.registry, self.stop_event, cfg.lifecycle.stall_timeout_s))
        self._spawn(self._collect())
        if cfg.lifecycle.watch_files:
            self._spawn(self.reloader.watch(self.stop_event))
        if self._reload_asked:  # a SIGHUP during the start-up: the config may have changed since
            self._on_reload_signal()

    async def _open_registry(self, budget: int) -> Registry:
        """Make the cache ready, open the fleet agent where [fleet] follows one (its bundles lay their
        model tables over the config's), then return the registry of the models."""
        cfg = self.cfg
        await asyncio.to_thread(self.cache.prepare)
        await asyncio.to_thread(uploads.clear, Path(cfg.cache.dir) / uploads.AREA)
        runner = BuildRunner(cfg.build, lambda: probe(cfg.memory.probe))
        self.fleet = await fleet_agent(cfg)
        return Registry(
            self.fleet.overlay_config(cfg) if self.fleet is not None else cfg,
            self.cache,
            runner,
            self.metrics,
            budget,
            self._on_state,
            wrap_instance=self._wedge.wrap if self._wedge else None,
        )

    async def _warm_and_announce(self, app: App, service: Service, registry: Registry) -> None:
        """Warm the request path, then say READY=1 with the status line."""
        service.warming = True
        largest_body = 0
        try:
            largest_body = await warm_request_path(app, registry, self._api_sockets)
        finally:
            service.warming = False
        service.status_line = self._summary()
        malloc.settle(largest_body)
        service.ready.set()
        systemd.ready(service.status_line)
        if self._wedge is not None:
            self._wedge.armed.set()
        log.info("ready: %s", service.status_line)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _set_status(self, text: str) -> None:
        if self.service is not None:
            self.service.status_line = text
        systemd.status(text)
        if self.mqtt is not None:  # a reload may have added or removed models
            self.mqtt.models_changed()

    def _refresh_status(self) -> None:
        if self.service is not None and self.service.ready.is_set():
            text = self._summary()
            if text != self.service.status_line:
                self._set_status(text)

    def _after_swap(self) -> None:
        self._refresh_status()
        self._spawn(self._collect())

    async def _collect(self) -> None:
        """Old generations, the quarantine and stale digests, in a thread, one run at a time."""
        if self.registry is None:
            return
        reg, c = self.registry, self.cfg.cache
        async with self._gc_lock:
            # Taken under the lock: a collection queued behind another sees the swaps made meanwhile.
            in_use = reg.keys_in_use() | {t.entry.key for t, _ in self._targets() if t.entry is not None}
            await asyncio.to_thread(
                collect,
                self.cache,
                c.keep_generations,
                in_use,
                c.quarantine_max_files,
                parse_size(c.quarantine_max_bytes),
            )

    def _targets(self) -> list[tuple[ModelRuntime, bool]]:
        return list(self.background.targets.values()) if self.background is not None else []

    def _on_reload_signal(self) -> None:
        if self.stop_event.is_set():
            return
        if self.reloader is None:
            log.info("SIGHUP during start-up: reloading once ready")
            self._reload_asked = True
            return
        self._spawn(self.reloader.reload())

    async def _serve(self, app: App) -> None:
        from edged.transports.http import listener

        listeners = listener.listeners_from(self.cfg, bind_socket)
        self._owned_socket = next((x.owned_path for x in listeners if x.owned_path and not x.memfd), None)
        self.app = app
        memfd = next((x for x in listeners if x.memfd), None)
        if memfd is not None:
            s = self.cfg.server
            self.fd_socket = FdSocket(memfd.sock, self.shm, s.max_connections, memfd.owned_path)
            self.fd_socket.start(asyncio.get_running_loop())
        self.server = await listener.start(app, self.cfg, [x for x in listeners if not x.memfd])
        assert self.service is not None
        await self.grpc.start(self.cfg, self.service, self.shm, app.admin_gid, bind_socket, app.bodies)
        # Unix sockets of the API, for the warm-up of the connection path (path_warmup.py).
        self._api_sockets = [
            str(x.sock.getsockname())
            for x in listeners
            if x.sock.family == socket.AF_UNIX and not x.memfd and not x.access.metrics_only and x.sock.getsockname()
        ]

    def _summary(self) -> str:
        assert self.registry is not None
        error = self.reloader.last_error if self.reloader is not None else ""
        return summary(self.registry, (t for t, _ in self._targets()), error)

    def _unready(self) -> str:
        return unready(self.registry)

    def _queue_depths(self) -> dict[str, int]:
        """Read by /metrics at scrape time: every configured model, with its requests in flight."""
        assert self.registry is not None
        # list(): /metrics renders off the loop, and a reload may add a model meanwhile.
        return {n: rt.queue.backlog if rt.queue else 0 for n, rt in list(self.registry.models.items())}

    def _on_state(self, rt: ModelRuntime) -> None:
        if self.mqtt is not None:
            self.mqtt.model_state(rt)

    def _loop_sample(self, lateness: float, stalled: bool) -> None:
        self.metrics.loop_lag.set(self.loopwatch.max_recent())
        if stalled:
            self.metrics.loop_stalls.inc()

    # --- signals and stop ---

    def _install_signals(self, loop: asyncio.AbstractEventLoop) -> None:
        for stop_sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(stop_sig, self._on_stop_signal, stop_sig)
        loop.add_signal_handler(signal.SIGHUP, self._on_reload_signal)
        # Signals that came before the loop took over (edged.lifecycle.early_signals), in order.
        for early in early_signals.take():
            if early == signal.SIGHUP:
                self._on_reload_signal()
            else:
                self._on_stop_signal(early)

    def _on_stop_signal(self, sig: int) -> None:
        self._signals += 1
        if self._signals > 1:
            log.warning("second %s: exiting now", signal.Signals(sig).name)
            if self.registry is not None:
                self.registry.runner.kill_all()
            for path in (self._owned_socket, self.fd_socket and self.fd_socket.owned_path):
                if path:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
            os._exit(1)
        log.info("%s: stopping", signal.Signals(sig).name)
        self.stop_event.set()

    async def _stop(self) -> None:
        systemd.stopping("draining requests")
        started = time.monotonic()
        self.loopwatch.stop()
        if self.fleet is not None:
            await self.fleet.stop()
        for task in list(self._tasks):
            task.cancel()
        if self.service is not None:
            self.service.stopping = True
        if self.server is not None:
            self.app.accepting = False
        self.grpc.stop_accepting()
        if self.fd_socket is not None:  # no new regions while draining
            self.fd_socket.close()
            self.fd_socket = None
        if self.registry is not None:
            self.registry.runner.kill_all()
        if self.background is not None:
            await self.background.stop()
        if self.server is not None:
            # uvicorn's int() of the drain time made anything below 1 s a drain of 0 s.
            config = getattr(self.server, "config", None)
            if config is not None:
                config.timeout_graceful_shutdown = self.cfg.lifecycle.drain_timeout_s
            self.server.should_exit = True
            await self.server.shutdown()
        await self.grpc.stop(self.cfg.lifecycle.drain_timeout_s)
        if self.mqtt is not None:
            await self.mqtt.stop()
        if self.registry is not None:
            for rt in self.registry.models.values():
                if rt.backend is not None:
                    await self.registry.unload(rt, ModelState.UNLOADED, "daemon stopping")
        self.shm.unregister()
        if self._owned_socket:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._owned_socket)
        log.info("stopped in %.2f s", time.monotonic() - started)


def serve(cfg: Config) -> int:
    early_signals.hold()  # idempotent: `edged serve` already called it first thing
    malloc.keep_large_buffers()
    isolate_library_files(cfg.cache.dir)
    systemd.setup_logging(cfg.server.log_level)
    daemon = Daemon(cfg)
    try:
        import uvloop

        return uvloop.run(daemon.run())
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(daemon.run())
