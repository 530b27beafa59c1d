"""The periodic telemetry document: memory budget and use, per-model counts, latency
percentiles and queue depth, so a fleet dashboard needs nothing but the broker."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edged.serving.service import Service

log = logging.getLogger(__name__)


class Telemetry:
    """The document, with each model's request rate since the previous one (what a dashboard
    or Home Assistant shows without computing differences itself)."""

    def __init__(self, service: Service, device: str) -> None:
        self.service = service
        self.device = device
        self._last: dict[str, tuple[float, int]] = {}  # model -> (monotonic time, requests)

    def rate(self, name: str, requests: int, now: float) -> float:
        then, before = self._last.get(name, (self.service_started_mono, 0))
        self._last[name] = (now, requests)
        elapsed = now - then
        return round(max(requests - before, 0) / elapsed, 3) if elapsed > 0 else 0.0

    @property
    def service_started_mono(self) -> float:
        return time.monotonic() - (time.time() - self.service.started)

    async def document(self) -> dict[str, Any]:
        service = self.service
        reg = service.registry
        metrics = service.metrics
        now = time.monotonic()
        models: dict[str, Any] = {}
        for name, rt in reg.models.items():
            st = metrics.model(name)
            models[name] = {
                "state": rt.state,
                "requests": st.requests,
                "requests_per_s": self.rate(name, st.requests, now),
                "failures": st.failures,
                **st.percentiles(),
                "queue": rt.queue.backlog if rt.queue is not None else 0,
            }
        for gone in set(self._last) - set(models):
            del self._last[gone]
        return {
            "device": self.device,
            "ts": round(time.time(), 3),
            "uptime_s": round(time.time() - service.started, 1),
            "ready": service.is_ready(),
            "status": service.status_line,
            "memory": {
                "source": service.memory.source,
                "total_bytes": service.memory.total,
                "available_bytes": await service.memory_available(),
                "budget_bytes": reg.budget,
                "used_bytes": reg.used(),
            },
            "models": models,
        }
