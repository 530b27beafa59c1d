"""The staged rollout: publish a model's new desired version to a growing share of a group's
devices, watch what they report, and pause (saying why) when too many fail.

Stages are percentages of the group's devices as the broker shows them when the rollout starts
(their retained states), in a fixed order (sorted by name), so that a rollout run again after a
pause goes to the same devices first. A stage short of 100% names its devices one by one
(``{prefix}/{device}/fleet/desired``, each override keeps the device's other models); the
last stage publishes the group's desired state, which devices that join later follow too, and
then clears the overrides it made. A stage is done when every device in it has settled on the
new version (serving it, or failed, rolled back or refused it) or ``stage_timeout_s`` passed (a
silent device counts as failed). Failures are counted over every device targeted so far; past
``max_failures`` (a fraction) the rollout pauses: nothing more is published, the reason goes to
``{prefix}/fleet/{group}/rollout`` (retained) and the command exits non-zero.

Everything it publishes is retained and QoS 1, so a broker restart loses none of it, and a
controller that stops halfway leaves the fleet in a consistent state (some devices on the new
version, the rest on the old), which running the same rollout again continues.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from edged.fleet import desired, protocol
from edged.fleet.view import FleetView

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    model: str
    target: desired.Target
    stages: tuple[float, ...] = (1.0, 10.0, 100.0)
    max_failures: float = 0.02
    stage_timeout_s: float = 1800.0
    discover_s: float = 1.0  # the retained states have all arrived once the broker is this quiet


@dataclass
class Outcome:
    done: bool
    reason: str
    devices: int = 0
    serving: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    stage_times: list[float] = field(default_factory=list)


def parse_stages(text: str) -> tuple[float, ...]:
    """``"1,10,100"`` → (1.0, 10.0, 100.0): increasing percentages, the last one 100."""
    try:
        stages = tuple(float(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise ValueError(f"--stages: expected percentages such as 1,10,100, got {text!r}") from None
    if not stages or any(b <= a for a, b in itertools.pairwise(stages)) or stages[0] <= 0 or stages[-1] != 100:
        raise ValueError(f"--stages: increasing percentages ending with 100, got {text!r}")
    return stages


def parse_fraction(text: str) -> float:
    """``"2%"`` → 0.02, ``"0.02"`` → 0.02, ``"1"`` → 1 device in 100 is not meant: 1 means 100%."""
    t = text.strip()
    value = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    if not 0 <= value <= 1:
        raise ValueError(f"--max-failures: a share between 0 and 100%, got {text!r}")
    return value


def stage_size(total: int, percent: float) -> int:
    return min(total, max(1, math.ceil(total * percent / 100)))


def settled(state: dict[str, Any] | None, model: str, t: desired.Target) -> str | None:
    """The device's phase for this version once it has settled on it, else None."""
    if state is None:
        return None
    m = (state.get("models") or {}).get(model)
    if not isinstance(m, dict):
        return None
    if m.get("version") == t.version and m.get("phase") == "serving":
        return "serving"
    if m.get("target") == t.version and m.get("phase") in protocol.FAILED:
        return str(m.get("phase"))
    return None


def readable_models(doc: dict[str, Any] | None) -> dict[str, desired.Target]:
    """The valid entries of a desired-state document already on the broker; an entry that
    devices would refuse is left out (the controller publishes it no further)."""
    out = {}
    models = (doc or {}).get("models")
    for name, m in models.items() if isinstance(models, dict) else ():
        try:
            t = msgspec.convert(m, desired.Target)
            desired.check_target(name, t, t.size)
        except (msgspec.ValidationError, desired.DesiredRefused):
            continue
        out[name] = t
    return out


class Rollout:
    def __init__(self, view: FleetView, plan: Plan, say: Callable[[str], None] = print) -> None:
        self.view = view
        self.plan = plan
        self.say = say

    def run(self) -> Outcome:
        view, plan = self.view, self.plan
        view.wait_quiet(plan.discover_s, max(10.0, plan.discover_s * 5))
        devices = sorted(view.snapshot())
        if not devices:
            return self._pause(Outcome(False, f"no device of group {view.group} reports on the broker"), "")
        out = Outcome(False, "", devices=len(devices))
        targeted: list[str] = []
        for percent in plan.stages:
            count = stage_size(len(devices), percent)
            new = devices[len(targeted) : count]
            started = time.monotonic()
            self._publish_stage(percent, new)
            targeted.extend(new)
            label = f"stage {percent:g}% ({count} of {len(devices)} devices)"
            self.say(f"{label}: published {plan.model} {plan.target.version}")
            self._wait_stage(targeted, out)
            out.stage_times.append(round(time.monotonic() - started, 3))
            share = len(out.failed) / len(targeted)
            self._status("running" if percent < 100 else "done", label, out)
            if share > plan.max_failures:
                worst = "; ".join(f"{d}: {why}" for d, why in sorted(out.failed.items())[:5])
                reason = (
                    f"{label}: {len(out.failed)} of {len(targeted)} failed ({share:.0%} > {plan.max_failures:.0%}): "
                    f"{worst}"
                )
                return self._pause(out, reason)
            self.say(f"{label}: {len(out.serving)} serving, {len(out.failed)} failed")
        self._clear_overrides(targeted)
        out.done, out.reason = True, f"{plan.model} {plan.target.version} rolled out to {len(devices)} devices"
        self._status("done", out.reason, out)
        return out

    # --- publishing -----------------------------------------------------------------------------

    def _publish_stage(self, percent: float, devices: Sequence[str]) -> None:
        view, plan = self.view, self.plan
        if percent >= 100:
            models = readable_models(view.group_desired)
            models.pop(plan.model, None)
            models[plan.model] = plan.target
            payload = desired.encode(models, self._rollout_id(), time.time())
            view.publish(protocol.group_desired(view.prefix, view.group), payload).wait_for_publish(30)
            return
        infos = []
        for device in devices:
            models = self._override_models(device)
            models[plan.model] = plan.target
            payload = desired.encode(models, self._rollout_id(), time.time())
            infos.append(view.publish(protocol.device_desired(view.prefix, device), payload))
        for info in infos:
            info.wait_for_publish(30)

    def _override_models(self, device: str) -> dict[str, desired.Target]:
        with self.view.cond:
            return readable_models(self.view.overrides.get(device))

    def _clear_overrides(self, devices: Sequence[str]) -> None:
        """The group's desired state now says it for everyone: the stage overrides go."""
        view = self.view
        infos = []
        for device in devices:
            models = self._override_models(device)
            models.pop(self.plan.model, None)
            payload = desired.encode(models, self._rollout_id(), time.time()) if models else b""
            infos.append(view.publish(protocol.device_desired(view.prefix, device), payload))
        for info in infos:
            info.wait_for_publish(30)

    def _rollout_id(self) -> str:
        return f"{self.plan.model}-{self.plan.target.version}"

    def _status(self, state: str, reason: str, out: Outcome) -> None:
        doc = {
            "state": state,
            "reason": reason,
            "model": self.plan.model,
            "version": self.plan.target.version,
            "devices": out.devices,
            "serving": len(out.serving),
            "failed": out.failed,
            "ts": round(time.time(), 3),
        }
        self.view.publish(
            protocol.rollout(self.view.prefix, self.view.group), json.dumps(doc).encode()
        ).wait_for_publish(30)

    def _pause(self, out: Outcome, reason: str) -> Outcome:
        out.done, out.reason = False, reason or out.reason
        self.say(f"paused: {out.reason}")
        self._status("paused", out.reason, out)
        return out

    # --- watching -------------------------------------------------------------------------------

    def _wait_stage(self, targeted: Sequence[str], out: Outcome) -> None:
        plan, view = self.plan, self.view

        def all_settled() -> bool:
            states = view.states
            return all(settled(states.get(d), plan.model, plan.target) for d in targeted)

        view.wait(all_settled, plan.stage_timeout_s)
        states = view.snapshot()
        out.serving, out.failed = [], {}
        for d in targeted:
            phase = settled(states.get(d), plan.model, plan.target)
            if phase == "serving":
                out.serving.append(d)
            else:
                m = ((states.get(d) or {}).get("models") or {}).get(plan.model) or {}
                out.failed[d] = f"{phase}: {m.get('reason', '')}" if phase else "no report in time"
