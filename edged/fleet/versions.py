"""The model version in the Prometheus metrics: ``edged_model_version_info{model,version,phase}``
is 1 for the version each model serves (an info metric: join it on ``model`` to label any other
family with the version), and ``edged_fleet_updates`` counts each model's settled attempts by
outcome, so an alert can fire on rollbacks across a fleet."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge

from edged.fleet.protocol import SETTLED

if TYPE_CHECKING:
    from edged.fleet.context import Agent
    from edged.serving.metrics import Metrics


class VersionMetrics:
    def __init__(self, metrics: Metrics, agent: Agent) -> None:
        r = metrics.registry
        self.agent = agent
        self.info = Gauge(
            "edged_model_version_info",
            "1 for the bundle version a model serves",
            ["model", "version", "phase"],
            registry=r,
        )
        self.updates = Counter(
            "edged_fleet_updates", "Fleet updates by model and outcome", ["model", "outcome"], registry=r
        )
        self._shown: dict[str, tuple[str, str]] = {}
        for name in agent.book.models:
            self.changed(name, agent.book.models[name].phase or "serving", count=False)

    def changed(self, name: str, phase: str, count: bool = True) -> None:
        labels = (name, self.agent.version(name) or "config", phase)
        old = self._shown.get(name)
        if old is not None and old != labels[1:]:
            self.info.remove(name, *old)
        self._shown[name] = labels[1:]
        self.info.labels(*labels).set(1)
        if count and phase in SETTLED:
            self.updates.labels(name, phase.replace(" ", "_")).inc()
