"""Memory: what there is (the probes) and the share of it edged may use (the budget).

Jetson memory is unified: the GPU allocates from RAM, so one budget covers both. jtop reports it
on a Jetson (``jetson.memory["RAM"]``, kB), NVML on a discrete GPU, ``/proc/meminfo`` elsewhere.
What to load into the budget is decided by ``edged.serving.admission``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from edged.config import MemoryConfig, format_size, parse_budget, parse_size

log = logging.getLogger(__name__)

JTOP_SOCKET = "/run/jtop.sock"


@dataclass(frozen=True)
class MemoryInfo:
    total: int
    available: int
    source: str
    detail: str = ""


# --- probes ---------------------------------------------------------------------------------------


def probe_meminfo(path: str = "/proc/meminfo") -> MemoryInfo:
    values: dict[str, int] = {}
    with open(path, encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                values[key] = int(parts[0]) * 1024
    total = values["MemTotal"]
    avail = values.get("MemAvailable", values.get("MemFree", 0))
    return MemoryInfo(total, avail, "meminfo")


def probe_jtop() -> MemoryInfo:
    """Through the jtop service (jetson-stats). Raises when jtop or its service is missing."""
    from jtop import jtop  # optional, Jetson only

    with jtop() as jetson:
        ram = jetson.memory["RAM"]
    total = int(ram["tot"]) * 1024
    used = int(ram["used"]) * 1024
    shared = int(ram.get("shared", 0)) * 1024
    available = max(0, total - used)
    try:
        # jtop's "used" leaves out reclaimable caches but counts /dev/shm (where clients put
        # frames) as free; the kernel's MemAvailable is the stricter figure when it is readable.
        available = min(available, probe_meminfo().available)
    except (OSError, KeyError, ValueError):
        pass
    return MemoryInfo(total, available, "jtop", f"GPU share {format_size(shared)}")


def probe_nvml() -> MemoryInfo:
    import pynvml  # optional: nvidia-ml-py, discrete GPUs

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        name = pynvml.nvmlDeviceGetName(handle)
    finally:
        pynvml.nvmlShutdown()
    name = name.decode() if isinstance(name, bytes) else str(name)
    return MemoryInfo(int(info.total), int(info.free), "nvml", name)


PROBES: dict[str, Callable[[], MemoryInfo]] = {
    "jtop": probe_jtop,
    "nvml": probe_nvml,
    "meminfo": probe_meminfo,
}


def probe(kind: str = "auto") -> MemoryInfo:
    """The configured probe, or the first that works: jtop (its socket exists), NVML, meminfo."""
    if kind != "auto":
        return PROBES[kind]()
    order = []
    if os.path.exists(JTOP_SOCKET):
        order.append("jtop")
    order += ["nvml", "meminfo"]
    failures = []
    for name in order:
        try:
            info = PROBES[name]()
        except Exception as e:  # a missing optional library or service: try the next probe
            failures.append(f"{name}: {e.__class__.__name__}: {e}")
            continue
        if failures:
            log.debug("memory probes skipped: %s", "; ".join(failures))
        return info
    raise RuntimeError("no memory probe works: " + "; ".join(failures))


def budget_bytes(cfg: MemoryConfig, info: MemoryInfo) -> int:
    """The configured share of total memory, less the reserve, never more than is available."""
    budget = parse_budget(cfg.budget, info.total)
    reserve = parse_size(cfg.reserve)
    return max(0, min(budget, info.available) - reserve)


def rss_bytes() -> int:
    """Resident memory of this process, for footprints backends cannot report themselves."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
