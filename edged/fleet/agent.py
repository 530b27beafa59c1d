"""The device side of the fleet: follow the desired state, report the state, send heartbeats.

The agent has a connection of its own to the broker (``edged-{device}-fleet-agent``, a clean
session: the desired state is retained, so a reconnect gets it again, and nothing queues for a
device that is away). It subscribes to its group's desired state and its own override, checks
each message (desired.py), and hands the models whose desired version differs from what serves
to one worker task, which takes them one at a time through download → verify → build and gate
→ swap → watch (attempt.py). The model's current version keeps serving throughout: the new one
is applied as a reload with the bundle's model table laid over the config file's (``overlay``),
which builds in the background and swaps under a hold exactly as a changed config file does.

It reports on ``{prefix}/{device}/fleet/state`` (retained) at every phase change, and sends a
compact heartbeat (heartbeat.py) every ``heartbeat_interval_s``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import paho.mqtt.client as mqtt

from edged.config import Config, ModelConfig, parse_size
from edged.errors import ConfigError
from edged.fleet import desired, ledger, protocol, rollback
from edged.fleet.fingerprint import device_fingerprint
from edged.fleet.heartbeat import Heartbeat
from edged.fleet.refusals import Refusal, Refusals
from edged.fleet.versions import VersionMetrics
from edged.fleet.worker import work
from edged.thread_to_loop import to_loop
from edged.transports.mqtt.link import Link

if TYPE_CHECKING:
    from edged.fleet.bundle import Bundle
    from edged.fleet.context import Cancellable
    from edged.lifecycle.reload import Reloader
    from edged.serving.background import BackgroundBuilds
    from edged.serving.registry import Registry
    from edged.serving.service import Service

log = logging.getLogger(__name__)

Reload = Callable[[], Awaitable[tuple[bool, str]]]  # applies the overlay: (done, why not)
Verify = Callable[[Path, Path], "Bundle"]  # (archive, folder to unpack into): the verified bundle; blocking


class FleetAgent:
    def __init__(self, cfg: Config, verify: Verify, book: ledger.Ledger, fingerprint: dict[str, str]) -> None:
        fleet = cfg.fleet
        self.cfg = cfg
        self.fleet = fleet
        self.verify = verify
        self.book = book
        self.area = Path(cfg.cache.dir) / "fleet"
        self.device = protocol.check_device(cfg.mqtt.device_id or socket.gethostname())
        self.prefix = protocol.check_prefix(cfg.mqtt.topic_prefix)
        self.group = fleet.group
        if self.group == "models":  # {prefix}/fleet/models/... are the shared request topics (docs/mqtt.md)
            raise ConfigError("fleet.group: 'models' names the fleet's request topics, not a group")
        self.max_bundle_bytes = parse_size(fleet.max_bundle_size)  # checked when the config loaded
        self.fingerprint = fingerprint
        self.group_doc: desired.Desired | None = None
        self.device_doc: desired.Desired | None = None
        self.refused_message = ""  # the last desired-state message refused, and why
        self.wanted: dict[str, desired.Target] = {}
        self.changed = asyncio.Event()
        self.overlay: dict[str, ModelConfig] = {}
        for name, rec in book.models.items():  # what served before a restart serves again at boot
            if rec.current is not None and Path(rec.current.bundle).is_dir():
                self.overlay[name] = msgspec.convert(rec.current.model, ModelConfig)
                if rec.phase == "watching":  # its watch ended with the restart: it stays
                    rec.phase, rec.reason, rec.floor = "serving", "", rec.current.version
        self.service: Service | None = None
        self.background: BackgroundBuilds | None = None
        self.reload: Reload | None = None
        self.versions: VersionMetrics | None = None
        self.refusals: Refusals | None = None
        self.link: Link | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._worker: asyncio.Task[None] | None = None
        self._saving = asyncio.Lock()
        self.current: Cancellable | None = None  # the attempt under way (one at a time)
        self.previous_windows: dict[str, rollback.Window] = {}  # the version before a swap, its traffic
        self._swap_counts: dict[str, tuple[int, int]] = {}  # requests and failures at the last swap
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    async def create(cls, cfg: Config, verify: Verify) -> FleetAgent:
        book = await asyncio.to_thread(ledger.load, Path(cfg.cache.dir) / "fleet" / "ledger.json")
        return cls(cfg, verify, book, await asyncio.to_thread(device_fingerprint))

    # --- wiring -----------------------------------------------------------------------------------

    def overlay_config(self, cfg: Config) -> Config:
        """The config file's models with each bundle's model table laid over its entry."""
        if not self.overlay:
            return cfg
        return msgspec.structs.replace(cfg, models={**cfg.models, **self.overlay})

    def version(self, name: str) -> str:
        rec = self.book.models.get(name)
        return rec.current.version if rec is not None and rec.current is not None else ""

    @property
    def registry(self) -> Registry:
        assert self.service is not None
        return self.service.registry

    async def start(self, service: Service, background: BackgroundBuilds, reloader: Reloader) -> None:
        """Called once the daemon is ready and its reloader exists: from now on every reload lays
        the bundles over the config file's models."""
        reloader.overlay = self.overlay_config

        async def reload() -> tuple[bool, str]:
            done = await reloader.reload()
            return done, reloader.last_error

        self.service, self.background, self.reload = service, background, reload
        self.refusals = Refusals(service.metrics.registry, self._refusal_event)
        service.sections["fleet"] = self.status_section
        self.versions = VersionMetrics(service.metrics, self)
        loop = self._loop = asyncio.get_running_loop()
        self.link = Link(self.cfg.mqtt, loop, f"edged-{self.device}-fleet-agent", False, self._connected, self._message)
        self.link.start()
        self._worker = loop.create_task(work(self))
        if self.fleet.heartbeat_interval_s:
            self.spawn(Heartbeat(self).run())

    async def stop(self) -> None:
        for task in [self._worker, *self._tasks]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in [self._worker, *self._tasks] if t is not None), return_exceptions=True)
        if self.link is not None:
            await self.link.stop()
        await self.save()

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def reload_now(self) -> tuple[bool, str]:
        assert self.reload is not None
        return await self.reload()

    def from_thread(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._loop is not None:
            to_loop(self._loop, fn, *args)

    # --- traffic, for the rollback policy ---------------------------------------------------------

    def window_since_swap(self, name: str) -> rollback.Window:
        """The model's requests, failures and p99 since its version last changed."""
        st = self.registry.metrics.model(name)
        r0, f0 = self._swap_counts.get(name, (0, 0))
        requests, failures = max(st.requests - r0, 0), max(st.failures - f0, 0)
        ok = requests - failures
        latencies = list(st.latencies)[-ok:] if ok > 0 else []
        p99 = round(float(np.percentile(latencies, 99)) * 1000, 3) if latencies else None
        return rollback.Window(requests, failures, p99)

    def swapped(self, name: str, before: rollback.Window) -> None:
        st = self.registry.metrics.model(name)
        self.previous_windows[name] = before
        self._swap_counts[name] = (st.requests, st.failures)

    # --- MQTT -------------------------------------------------------------------------------------

    def _connected(self, session_present: bool) -> None:
        assert self.link is not None
        for topic in (
            protocol.group_desired(self.prefix, self.group),
            protocol.device_desired(self.prefix, self.device),
        ):
            self.link.client.subscribe(topic, qos=1)
        self.publish_state()
        log.info("fleet: following group %s as device %s", self.group, self.device)

    def _message(self, link: Link, msg: mqtt.MQTTMessage) -> None:
        d = link.deliveries.receive("", msg.mid, msg.qos, False, len(msg.payload), 0)
        try:
            self._desired(msg.topic, bytes(msg.payload))
        except Exception:  # a message must never stop the next one
            log.exception("fleet: cannot handle a message")
        finally:
            link.deliveries.finish(d)

    def _desired(self, topic: str, payload: bytes) -> None:
        f = self.fleet
        try:
            doc = desired.parse(payload, f.max_desired_bytes, f.max_models, self.max_bundle_bytes)
        except desired.DesiredRefused as e:
            self.refused_message = f"{topic}: {e.reason} ({e.code})"
            log.warning("fleet: refused the desired state on %s: %s", topic, e.reason)
            self.publish_state()
            return
        if topic == protocol.group_desired(self.prefix, self.group):
            self.group_doc = doc
        elif topic == protocol.device_desired(self.prefix, self.device):
            self.device_doc = doc
        else:
            return
        self.refused_message = ""
        wanted = desired.effective(self.group_doc, self.device_doc)
        if wanted != self.wanted:
            self.wanted = wanted
            self.changed.set()
            a = self.current
            if a is not None and (wanted.get(a.name) is None or wanted[a.name].key != a.t.key):
                a.cancel.set()  # a download of a version no longer wanted stops at its next chunk
        self.publish_state()

    # --- the state ------------------------------------------------------------------------------

    def state_doc(self) -> dict[str, Any]:
        models: dict[str, Any] = {}
        for name, rec in sorted(self.book.models.items()):
            want = self.wanted.get(name)
            models[name] = {
                "version": rec.current.version if rec.current else "",
                "desired": want.version if want else "",
                "target": rec.target,
                "phase": rec.phase,
                "reason": rec.reason,
                "gate": rec.gate,
                "build_s": rec.build_s,
                "previous": rec.previous.version if rec.previous else "",
                "since": rec.changed,
            }
        return {
            "device": self.device,
            "group": self.group,
            "ts": round(time.time(), 3),
            "fingerprint": self.fingerprint,
            "models": models,
            "refused": self.refused_message,
        }

    def status_section(self) -> dict[str, Any]:
        """The ``fleet`` section of ``/v2/edged/status`` (``edged status --json``)."""
        doc = self.state_doc()
        doc["bundle_refusals"] = self.refusals.status() if self.refusals is not None else {}
        return doc

    def _refusal_event(self, refusal: Refusal) -> None:
        """From the worker thread that refused the bundle: published from the loop."""
        self.from_thread(self._publish_event, msgspec.json.encode(refusal.event()))

    def _publish_event(self, payload: bytes) -> None:
        if self.link is not None and self.link.connected.is_set():
            self.link.publish(protocol.device_events(self.prefix, self.device), payload, qos=1)

    def publish_state(self) -> None:
        if self.link is not None and self.link.connected.is_set():
            topic = protocol.device_state(self.prefix, self.device)
            self.link.publish(topic, msgspec.json.encode(self.state_doc()), qos=1, retain=True)

    def set_phase(self, name: str, phase: str, reason: str = "", **fields: Any) -> None:
        rec = self.book.record(name)
        rec.phase, rec.reason, rec.changed = phase, reason, round(time.time(), 3)
        for key, value in fields.items():
            setattr(rec, key, value)
        level = logging.WARNING if phase in protocol.FAILED else logging.INFO
        log.log(
            level,
            "fleet: %s %s: %s%s",
            name,
            rec.target,
            phase,
            f": {reason}" if reason else "",
            extra={"model": name, "phase": phase},
        )
        if self.versions is not None:
            self.versions.changed(name, phase)
        self.publish_state()
        self.spawn(self.save())

    async def save(self) -> None:
        data = msgspec.json.encode(self.book)
        async with self._saving:  # one write at a time, the newest last
            await asyncio.to_thread(ledger.save, self.area / "ledger.json", data)
