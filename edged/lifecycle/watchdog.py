"""systemd's watchdog, pinged while every inference worker makes progress.

With WatchdogSec= in the unit, systemd restarts the daemon when no ping comes for that long. The
pings are withheld while a worker has held one request for over ``lifecycle.stall_timeout_s``:
an event loop that still runs is not enough, since a wedged accelerator or library would keep
that model's requests waiting for ever, and a restart frees it.
"""

from __future__ import annotations

import asyncio
import logging

from edged.host import systemd
from edged.serving.registry import Registry

# A stuck worker is the daemon's condition: its line carries the daemon's logger name, which is
# what operators read and filter the daemon's lines by.
log = logging.getLogger("edged.lifecycle.daemon")


async def watchdog(registry: Registry, stop_event: asyncio.Event, stall: float) -> None:
    interval = systemd.watchdog_interval()
    if not interval:
        return
    while not stop_event.is_set():
        if _healthy(registry, stall):
            systemd.watchdog_ping()
        else:
            log.error("an inference worker is stuck for over %.0f s; withholding watchdog pings", stall)
        await asyncio.sleep(interval / 2)


def _healthy(registry: Registry, stall: float) -> bool:
    return all(rt.queue is None or rt.queue.healthy(stall) for rt in registry.models.values())
