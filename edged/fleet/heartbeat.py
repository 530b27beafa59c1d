"""The compact heartbeat: one short JSON document per device per interval on
``{prefix}/fleet/{group}/heartbeat/{device}`` (QoS 0, not retained), which a central broker
aggregates with one subscription (``{prefix}/fleet/+/heartbeat/+``, or a shared subscription
among several collectors). Keys are short because a fleet multiplies every byte:

    {"d": "cam-07", "t": 1767350000, "up": 86400, "ok": 1,
     "mem": [avail_mib, used_mib, budget_mib],
     "m": {"det": ["2.1.0", "serving", p50_ms, p99_ms, requests, failures]}}

With one model this is about 180 bytes; at the default minute it stays under 1 KB a minute
with several models (docs/performance.md has the measured figure).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec

from edged.fleet import protocol

if TYPE_CHECKING:
    from edged.fleet.context import Agent

log = logging.getLogger(__name__)
MIB = 1 << 20


class Heartbeat:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.topic = protocol.heartbeat(agent.prefix, agent.group, agent.device)

    async def document(self) -> dict[str, Any]:
        agent = self.agent
        service = agent.service
        assert service is not None
        reg = service.registry
        models: dict[str, list[Any]] = {}
        for name, rt in list(reg.models.items()):
            st = service.metrics.model(name)
            p = st.percentiles()
            rec = agent.book.models.get(name)
            phase = rec.phase if rec is not None and rec.phase else str(rt.state)
            models[name] = [agent.version(name), phase, p["p50_ms"], p["p99_ms"], st.requests, st.failures]
        available = await service.memory_available()
        return {
            "d": agent.device,
            "t": int(time.time()),
            "up": int(time.time() - service.started),
            "ok": int(service.is_ready()),
            "mem": [available // MIB if available is not None else None, reg.used() // MIB, reg.budget // MIB],
            "m": models,
        }

    async def run(self) -> None:
        interval = self.agent.fleet.heartbeat_interval_s
        while True:
            await asyncio.sleep(interval)
            link = self.agent.link
            if link is None or not link.connected.is_set():
                continue
            try:
                payload = msgspec.json.encode(await self.document())
            except Exception:  # a heartbeat must never take the agent down
                log.exception("fleet: heartbeat failed")
                continue
            link.publish(self.topic, payload, qos=0)
