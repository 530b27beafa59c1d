"""The event loop's own latency, measured continuously.

A timer due every ``probe_ms`` records how late it fires: lateness is time the loop spent on
something else (a blocking call, a long callback) while requests, health checks and MQTT
keep-alives waited. The worst lateness of each interval is exported as a gauge, every lateness
above ``stall_ms`` counts as one stall and is logged once, with its length.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

Report = Callable[[float, bool], None]  # (lateness in seconds, a stall) per sample


class LoopWatch:
    def __init__(
        self,
        probe_ms: int,
        stall_ms: int,
        on_sample: Report | None = None,
        window_s: float = 10.0,
    ) -> None:
        self.probe = probe_ms / 1000
        self.stall = stall_ms / 1000
        self.window_s = window_s
        self._on_sample = on_sample
        self.stalls = 0
        self.worst = 0.0  # the largest lateness of the current window
        self.last_window_worst = 0.0
        self._window_end = 0.0
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._window_end = time.monotonic() + self.window_s
        self._arm(loop)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def max_recent(self) -> float:
        """The worst lateness of the last full window, or of the current one if that is worse."""
        return max(self.worst, self.last_window_worst)

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        self._due = time.monotonic() + self.probe
        self._handle = loop.call_later(self.probe, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        now = time.monotonic()
        self.sample(now - self._due, now)
        self._arm(loop)

    def sample(self, lateness: float, now: float) -> None:
        lateness = max(0.0, lateness)
        if now >= self._window_end:
            self.last_window_worst, self.worst = self.worst, 0.0
            self._window_end = now + self.window_s
        self.worst = max(self.worst, lateness)
        stalled = lateness > self.stall
        if stalled:
            self.stalls += 1
            log.warning("event loop stalled for %.0f ms", lateness * 1000)
        if self._on_sample is not None:
            self._on_sample(lateness, stalled)
