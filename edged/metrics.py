"""Counters and histograms (Prometheus text through prometheus_client) and the recent-latency
window that telemetry reports as percentiles."""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
            1.0, 2.5, 5.0, 10.0)


@dataclass
class ModelStats:
    """Per-model figures kept cheaply on the request path."""

    requests: int = 0
    failures: int = 0
    latencies: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=2048)
    )

    def percentiles(self) -> dict[str, float | None]:
        if not self.latencies:
            return {"p50_ms": None, "p90_ms": None, "p99_ms": None}
        arr = np.fromiter(self.latencies, dtype=np.float64) * 1000
        p50, p90, p99 = np.percentile(arr, [50, 90, 99])
        return {"p50_ms": round(float(p50), 3), "p90_ms": round(float(p90), 3),
                "p99_ms": round(float(p99), 3)}


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("edged_requests", "Inference requests by model, transport and outcome",
                                ["model", "transport", "outcome"], registry=r)
        self.latency = Histogram("edged_request_seconds", "Inference latency inside the daemon",
                                 ["model"], buckets=_BUCKETS, registry=r)
        self.queue = Gauge("edged_queue_depth", "Requests queued or running", ["model"], registry=r)
        self.state = Gauge("edged_model_ready", "1 when the model serves", ["model"], registry=r)
        self.footprint = Gauge("edged_model_footprint_bytes", "Memory a loaded model holds",
                               ["model"], registry=r)
        self.budget = Gauge("edged_memory_budget_bytes", "Memory budget for models", registry=r)
        self.dropped = Counter("edged_dropped", "Requests dropped before running (expired, busy)",
                               ["model", "reason"], registry=r)
        self.builds = Counter("edged_builds", "Engine builds by outcome", ["model", "outcome"],
                              registry=r)
        self.stats: dict[str, ModelStats] = {}
        self._lock = threading.Lock()

    def model(self, name: str) -> ModelStats:
        st = self.stats.get(name)
        if st is None:
            with self._lock:
                st = self.stats.setdefault(name, ModelStats())
        return st

    def observe(self, model: str, transport: str, outcome: str, seconds: float) -> None:
        st = self.model(model)
        st.requests += 1
        if outcome != "ok":
            st.failures += 1
        else:
            st.latencies.append(seconds)
            self.latency.labels(model).observe(seconds)
        self.requests.labels(model, transport, outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
