from __future__ import annotations

from edged.config import MemoryConfig
from edged.memory import PlanItem, budget_bytes, choose_evictions, plan, probe_meminfo

MiB = 1 << 20


def item(name: str, prio: int, mib: int, preload: str = "boot", measured: bool = True) -> PlanItem:
    return PlanItem(name, prio, preload, mib * MiB, measured)


def test_boot_models_admitted_by_priority() -> None:
    p = plan([item("low", 10, 60), item("high", 90, 60), item("mid", 50, 30)], 100 * MiB)
    assert p.admitted == ("high", "mid")
    assert p.used == 90 * MiB
    assert set(p.deferred) == {"low"}
    assert p.deferred["low"] == "budget: needs 60.0 MiB (measured), 10.0 MiB left of 100.0 MiB"


def test_smaller_model_still_fits_after_a_deferred_one() -> None:
    p = plan([item("big", 90, 80), item("huge", 80, 500), item("small", 10, 10)], 100 * MiB)
    assert p.admitted == ("big", "small")
    assert "estimated" not in p.deferred["huge"]


def test_lazy_models_are_not_loaded_at_boot_and_ties_are_stable() -> None:
    p = plan([item("b", 50, 10), item("a", 50, 10), item("z", 99, 10, "lazy", measured=False)], 100 * MiB)
    assert p.admitted == ("a", "b")
    assert p.lazy == ("z",)
    assert p.to_dict()["lazy"] == ["z"]


def test_estimates_are_labelled() -> None:
    p = plan([item("a", 50, 200, measured=False)], 100 * MiB)
    assert "(estimated)" in p.deferred["a"]


def test_evictions_least_recently_used_first() -> None:
    cands = [("old", 30 * MiB, 1.0), ("new", 30 * MiB, 9.0), ("mid", 30 * MiB, 5.0)]
    assert choose_evictions(10 * MiB, 20 * MiB, cands) == []
    assert choose_evictions(40 * MiB, 20 * MiB, cands) == ["old"]
    assert choose_evictions(70 * MiB, 20 * MiB, cands) == ["old", "mid"]
    assert choose_evictions(500 * MiB, 20 * MiB, cands) is None


def test_budget_from_meminfo(tmp_path) -> None:
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       1000000 kB\nMemFree: 10 kB\nMemAvailable:    800000 kB\n")
    info = probe_meminfo(str(f))
    assert (info.total, info.available) == (1000000 * 1024, 800000 * 1024)
    # 50% of total, less the reserve; never more than is available.
    assert budget_bytes(MemoryConfig(budget="50%", reserve="0"), info) == 500000 * 1024
    assert budget_bytes(MemoryConfig(budget="100%", reserve="1KiB"), info) == 800000 * 1024 - 1024
