"""``edged plan`` and ``edged build``: the daemon's resolve/plan/build steps, run offline.

They use the same registry code as ``serve`` so the plan printed is the plan the daemon follows,
and a device provisioned with ``edged build`` boots on cache hits only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TextIO

from edged.cache.store import EngineCache
from edged.config import Config, format_size
from edged.errors import EdgedError
from edged.host.memory import budget_bytes, probe
from edged.paths import isolate_library_files
from edged.quantize.figures import describe, precision_text
from edged.quantize.runner import BuildRunner
from edged.serving.admission import plan
from edged.serving.metrics import Metrics
from edged.serving.registry import Registry
from edged.serving.states import ModelState
from edged.tools.table import print_table

# Nothing to plan or build: it failed to resolve, or its backend's library is not installed yet.
_UNUSABLE = (ModelState.FAILED, ModelState.WAITING)


def _registry(cfg: Config) -> tuple[Registry, dict[str, Any]]:
    isolate_library_files(cfg.cache.dir)
    info = probe(cfg.memory.probe)
    budget = budget_bytes(cfg.memory, info)
    cache = EngineCache(cfg.cache.dir)
    cache.prepare()
    reg = Registry(cfg, cache, BuildRunner(cfg.build, lambda: probe(cfg.memory.probe)), Metrics(), budget)
    for rt in reg.models.values():
        try:
            reg.resolve(rt)
        except EdgedError as e:
            reg.set_state(rt, ModelState.FAILED, e.message)
        else:
            if rt.waits_for:  # nothing to plan or build until its backend's library is installed
                reg.set_state(rt, ModelState.WAITING, rt.backend_reason)
    mem = {
        "source": info.source,
        "total_bytes": info.total,
        "available_bytes": info.available,
        "budget_bytes": budget,
        "detail": info.detail,
    }
    return reg, mem


def offline_plan(cfg: Config) -> dict[str, Any]:
    reg, mem = _registry(cfg)
    ok = [rt for rt in reg.models.values() if rt.state not in _UNUSABLE]
    the_plan = plan([rt.plan_item() for rt in ok], reg.budget)
    models = []
    for rt in reg.models.values():
        if rt.state in _UNUSABLE:
            decision, reason = rt.state.value, rt.reason
        elif rt.name in the_plan.deferred:
            decision, reason = ModelState.DEFERRED.value, the_plan.deferred[rt.name]
        elif rt.name in the_plan.lazy:
            decision, reason = ModelState.LAZY.value, "loads on first request"
        else:
            decision, reason = "boot", ""
        if rt.precision_reason:
            reason = "; ".join(filter(None, [reason, rt.precision_reason]))
        models.append(
            {
                "name": rt.name,
                "decision": decision,
                "reason": reason,
                "backend": rt.backend_cls.name if rt.backend_cls else (rt.waits_for or "-"),
                "precision": rt.stored_precision or rt.precision or "-",
                "requested_precision": rt.cfg.precision,
                "priority": rt.cfg.priority,
                "footprint_bytes": rt.footprint,
                "measured": rt.measured,
                "cached": rt.entry is not None,
                "gate": rt.gate,
                "auto": rt.auto,
            }
        )
    reg.digests.save()
    return {"memory": mem, "plan": the_plan.to_dict(), "models": models}


def _progress_bar(out: TextIO, name: str) -> Callable[[str, float | None], None]:
    return lambda phase, fraction: _bar(out, name, phase, fraction)


def _bar(out: TextIO, name: str, phase: str, fraction: float | None) -> None:
    if fraction is None:
        out.write(f"\r  {name}: {phase:<40}")
    else:
        filled = int(fraction * 30)
        out.write(f"\r  {name}: [{'#' * filled}{'.' * (30 - filled)}] {fraction * 100:3.0f}% {phase:<24}")
    out.flush()


async def build_all(cfg: Config, check: bool, out: TextIO) -> int:
    reg, _ = _registry(cfg)
    missing = [rt for rt in reg.models.values() if rt.state not in _UNUSABLE and rt.entry is None]
    if check:
        for rt in missing:
            out.write(f"{rt.name}: needs a build ({rt.precision} with {rt.job.backend if rt.job else '?'})\n")
        failed = [rt for rt in reg.models.values() if rt.state in _UNUSABLE]
        for rt in failed:
            out.write(f"{rt.name}: {rt.reason}\n")
        out.write("all engines are built\n" if not missing and not failed else "")
        return 1 if missing or failed else 0
    rows = []
    for rt in reg.models.values():
        started = time.monotonic()
        if rt.state not in _UNUSABLE and rt.entry is None:
            try:
                await reg.build(rt, _progress_bar(out, rt.name))
                out.write("\n")
            except EdgedError as e:
                reg.set_state(rt, ModelState.FAILED, e.message)
                out.write("\n")
        gate = rt.gate or {}
        rows.append(
            (
                rt.name,
                rt.state if rt.state in _UNUSABLE else "ok",
                precision_text(rt.precision, rt.gate),
                _gate_text(gate),
                f"{time.monotonic() - started:.1f}s",
                format_size(rt.footprint) if rt.footprint else "-",
                rt.reason or rt.precision_reason,
            )
        )
    print_table(("model", "result", "precision", "gate", "build", "footprint", "note"), rows)
    reg.digests.save()
    return 1 if any(r[1] in _UNUSABLE for r in rows) else 0


def _gate_text(gate: dict[str, Any]) -> str:
    return describe(gate)
