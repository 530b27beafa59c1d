"""The memory reading the daemon starts from, and the line that reports it with its budget.

The probe is the configured one (``memory.probe``), or the first that works here. A probe named
in the configuration that does not work on this device is a configuration error, so the daemon
exits 78 and systemd does not restart it; with ``auto`` the probe's own error stands.
"""

from __future__ import annotations

import asyncio
import logging

from edged.config import MemoryConfig, format_size
from edged.errors import ConfigError
from edged.host.memory import MemoryInfo, probe

# The budget is the first line of the daemon's start-up: it carries the daemon's logger name,
# which is what operators read and filter the start-up by.
log = logging.getLogger("edged.lifecycle.daemon")


async def probe_memory(cfg: MemoryConfig) -> MemoryInfo:
    kind = cfg.probe
    try:
        return await asyncio.to_thread(probe, kind)  # jtop can block about a second
    except Exception as e:
        if kind != "auto":
            raise ConfigError(f"memory.probe = {kind!r} does not work here: {e.__class__.__name__}: {e}") from e
        raise


def log_budget(memory: MemoryInfo, budget: int) -> None:
    log.info(
        "memory from %s: %s total, %s available, budget %s%s",
        memory.source,
        format_size(memory.total),
        format_size(memory.available),
        format_size(budget),
        f" ({memory.detail})" if memory.detail else "",
    )
