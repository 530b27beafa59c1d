"""Admission: which models the memory budget takes at boot, and which lazy ones to evict for another.

A pure function of (models, footprints, budget), so it can be tested alone and ``edged plan``
shows exactly what ``serve`` will do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from edged.config import format_size


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
