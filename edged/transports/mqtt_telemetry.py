"""The periodic telemetry document: memory budget and use, per-model counts, latency
percentiles and queue depth, so a fleet dashboard needs nothing but the broker."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from edged.memory import probe

if TYPE_CHECKING:
    from edged.service import Service

log = logging.getLogger(__name__)


async def available_now(service: Service) -> int | None:
    """Free memory from the configured probe, off the loop (jtop answers over a socket)."""
    try:
        info = await asyncio.to_thread(probe, service.registry.cfg.memory.probe)
    except Exception as e:  # a probe that fails now still leaves the rest of the telemetry
        log.debug("telemetry: memory probe failed: %s", e)
        return None
    return info.available


async def telemetry(service: Service, device: str) -> dict[str, Any]:
    reg = service.registry
    metrics = service.metrics
    models: dict[str, Any] = {}
    for name, rt in reg.models.items():
        st = metrics.model(name)
        models[name] = {
            "state": rt.state,
            "requests": st.requests,
            "failures": st.failures,
            **st.percentiles(),
            "queue": rt.queue.pending if rt.queue is not None else 0,
        }
    return {
        "device": device,
        "ts": round(time.time(), 3),
        "uptime_s": round(time.time() - service.started, 1),
        "ready": service.is_ready(),
        "status": service.status_line,
        "memory": {
            "source": service.memory.source,
            "total_bytes": service.memory.total,
            "available_bytes": await available_now(service),
            "budget_bytes": reg.budget,
            "used_bytes": reg.used(),
        },
        "models": models,
    }
