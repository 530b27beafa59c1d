"""What the daemon says about itself: the one-line summary (STATUS=, the status line) and whether
it is ready (``/v2/health/ready``).

Ready means every boot model has settled and at least one of them serves. Settled: it serves (on
its engine, or on a stand-in while its engine builds), or it is degraded with its reason (deferred
by the budget, lazy, unloaded by an operator, failed, waiting for its backend's library), which
the summary gives. A waiting model does not hold readiness back: its library may take minutes to
install, or never come, and the other models serve meanwhile; once it joins it serves too.
"""

from __future__ import annotations

from collections.abc import Iterable

from edged.serving.registry import ModelRuntime, Registry
from edged.serving.states import ModelState


def summary(registry: Registry, building: Iterable[ModelRuntime], reload_error: str = "") -> str:
    models = list(registry.models.values())
    states = [rt.state for rt in models]
    parts = [f"{states.count(ModelState.READY)} models ready"]
    standing = [rt for rt in models if rt.state == ModelState.READY and rt.reason.startswith("serving on")]
    if standing:
        parts[0] += " (" + "; ".join(f"{rt.name} {rt.reason}" for rt in standing) + ")"
    for state in (ModelState.LAZY, ModelState.DEFERRED, ModelState.WAITING, ModelState.FAILED):
        n = states.count(state)
        if n:
            reasons = {rt.reason.split(":")[0] for rt in models if rt.state == state}
            parts.append(f"{n} {state}" + (f": {', '.join(sorted(reasons))}" if state != ModelState.LAZY else ""))
    unserved = [t for t in building if registry.models.get(t.name) is t]
    if unserved:
        parts.append(f"{len(unserved)} building")
    text = ", ".join(parts)
    if reload_error:
        # Kept until a later reload succeeds: the running config is not the one on disk.
        text += f"; reload failed: {reload_error}"
    return text


def unready(registry: Registry | None) -> str:
    """'' when ready; otherwise why not."""
    if registry is None:
        return "starting"
    boot = [rt for rt in registry.models.values() if rt.cfg.preload == "boot"]
    waiting = [f"{rt.name} is {rt.state}" for rt in boot if not rt.state.settled]
    if waiting:
        return "; ".join(waiting)
    if boot and not any(rt.state == ModelState.READY for rt in boot):
        return "no boot model serves"
    return ""
