"""Memory: what there is (probes) and what to load into it (the planner).

Jetson memory is unified: the GPU allocates from RAM, so one budget covers both. jtop reports it
on a Jetson (``jetson.memory["RAM"]``, kB), NVML on a discrete GPU, ``/proc/meminfo`` elsewhere.
The planner is a pure function of (models, footprints, budget) so it can be tested alone and
``edged plan`` shows exactly what ``serve`` will do.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

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


# --- planner --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanItem:
    name: str
    priority: int
    preload: str  # "boot" | "lazy"
    footprint: int
    measured: bool  # False: an estimate from the file size (first boot)


@dataclass(frozen=True)
class Plan:
    budget: int
    admitted: tuple[str, ...]
    deferred: dict[str, str] = field(default_factory=dict)
    lazy: tuple[str, ...] = ()
    used: int = 0

    def to_dict(self) -> dict[str, object]:
        return {
            "budget_bytes": self.budget,
            "used_bytes": self.used,
            "admitted": list(self.admitted),
            "deferred": dict(self.deferred),
            "lazy": list(self.lazy),
        }


def plan(items: Sequence[PlanItem], budget: int) -> Plan:
    """Admit boot models by priority (then name, so the plan is stable) while they fit.

    A model that does not fit is deferred with a reason; a smaller model of lower priority may
    still be admitted after it, since leaving memory idle helps nobody.
    """
    used = 0
    admitted: list[str] = []
    deferred: dict[str, str] = {}
    boot = sorted((i for i in items if i.preload == "boot"), key=lambda i: (-i.priority, i.name))
    for item in boot:
        if used + item.footprint <= budget:
            admitted.append(item.name)
            used += item.footprint
        else:
            kind = "measured" if item.measured else "estimated"
            deferred[item.name] = (
                f"budget: needs {format_size(item.footprint)} ({kind}), "
                f"{format_size(max(0, budget - used))} left of {format_size(budget)}"
            )
    lazy = tuple(sorted(i.name for i in items if i.preload == "lazy"))
    return Plan(budget, tuple(admitted), deferred, lazy, used)


def choose_evictions(needed: int, free: int, candidates: Sequence[tuple[str, int, float]]) -> list[str] | None:
    """Least recently used first: which lazy models (name, footprint, last use) to evict so that
    ``needed`` bytes fit. None when even evicting all of them is not enough."""
    if needed <= free:
        return []
    chosen = []
    for name, footprint, _ in sorted(candidates, key=lambda c: c[2]):
        chosen.append(name)
        free += footprint
        if needed <= free:
            return chosen
    return None


def rss_bytes() -> int:
    """Resident memory of this process, for footprints backends cannot report themselves."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
