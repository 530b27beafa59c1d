from __future__ import annotations

import asyncio
from pathlib import Path

from edged.cache.store import EngineCache
from edged.config import MemoryConfig, from_mapping
from edged.host.memory import budget_bytes, probe_meminfo
from edged.lifecycle.boot import Boot
from edged.quantize.runner import BuildRunner
from edged.serving.admission import PlanItem, choose_evictions, plan
from edged.serving.background import BackgroundBuilds
from edged.serving.metrics import Metrics
from edged.serving.registry import ModelRuntime, Registry

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


def test_budget_from_meminfo(tmp_path: Path) -> None:
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       1000000 kB\nMemFree: 10 kB\nMemAvailable:    800000 kB\n")
    info = probe_meminfo(str(f))
    assert (info.total, info.available) == (1000000 * 1024, 800000 * 1024)
    # 50% of total, less the reserve; never more than is available.
    assert budget_bytes(MemoryConfig(budget="50%", reserve="0"), info) == 500000 * 1024
    assert budget_bytes(MemoryConfig(budget="100%", reserve="1KiB"), info) == 800000 * 1024 - 1024


def _boot(tmp_path: Path, budget_mib: int) -> tuple[Boot, list[ModelRuntime], dict[str, ModelRuntime]]:
    """The boot planner on a real registry: 'a' has its engine, 'b' builds behind a stand-in."""
    cfg = from_mapping({"models": {"a": {"path": "a.onnx"}, "b": {"path": "b.onnx"}}}, base=tmp_path)
    cache = EngineCache(tmp_path / "cache")
    reg = Registry(cfg, cache, BuildRunner(cfg.build, probe_meminfo), Metrics(), budget_mib * MiB)
    a, b = reg.models["a"], reg.models["b"]
    a.footprint, b.footprint = 30 * MiB, 40 * MiB
    sub = ModelRuntime("b", b.cfg, stands_in_for="onnxruntime int8", footprint=25 * MiB)
    loop = asyncio.new_event_loop()
    loop.close()  # the planner never touches the loop
    return Boot(reg, BackgroundBuilds(reg, loop, lambda: None, lambda: None), loop), [a, b], {"b": sub}


def test_the_plan_counts_the_stand_in_and_the_engine_together(tmp_path: Path) -> None:
    boot, models, subs = _boot(tmp_path, budget_mib=100)
    p = boot.plan(models, subs)
    assert p.admitted == ("a", "b") and p.used == (30 + 40 + 25) * MiB
    assert "b" in subs


def test_without_room_for_both_the_engine_is_built_first(tmp_path: Path) -> None:
    boot, models, subs = _boot(tmp_path, budget_mib=80)  # 30 + 40 fits, 30 + 40 + 25 does not
    p = boot.plan(models, subs)
    assert p.admitted == ("a", "b") and p.used == 70 * MiB
    assert subs == {}  # no stand-in: b is built before READY=1, as with block_ready
