"""Counters and histograms, rendered as Prometheus text by prometheus_client at scrape time.

The request path only bumps plain integers in a per-model record (a couple of microseconds);
a custom collector turns them into Prometheus families when ``/metrics`` is read. Updating
prometheus_client's labelled metrics on every request took locks and label look-ups that cost
more than the tiny model's whole inference.
"""

from __future__ import annotations

import bisect
import collections
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class ModelStats:
    """Per-model figures kept cheaply on the request path (the event loop is the only writer)."""

    requests: int = 0
    failures: int = 0
    outcomes: dict[tuple[str, str], int] = field(default_factory=dict)
    buckets: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    seconds_sum: float = 0.0
    latencies: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=2048))

    def percentiles(self) -> dict[str, float | None]:
        if not self.latencies:
            return {"p50_ms": None, "p90_ms": None, "p99_ms": None}
        arr = np.fromiter(self.latencies, dtype=np.float64) * 1000
        p50, p90, p99 = np.percentile(arr, [50, 90, 99])
        return {"p50_ms": round(float(p50), 3), "p90_ms": round(float(p90), 3), "p99_ms": round(float(p99), 3)}


class _StatsCollector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        reqs = CounterMetricFamily(
            "edged_requests",
            "Inference requests by model, transport and outcome",
            labels=["model", "transport", "outcome"],
        )
        hist = HistogramMetricFamily("edged_request_seconds", "Inference latency inside the daemon", labels=["model"])
        for name, st in list(self._metrics.stats.items()):
            for (transport, outcome), n in list(st.outcomes.items()):
                reqs.add_metric([name, transport, outcome], n)
            cumulative, total = [], 0
            for bound, n in zip((*map(str, BUCKETS), "+Inf"), st.buckets):
                total += n
                cumulative.append((bound, total))
            hist.add_metric([name], cumulative, st.seconds_sum)
        yield reqs
        yield hist


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.queue = Gauge("edged_queue_depth", "Requests queued or running", ["model"], registry=r)
        self.state = Gauge("edged_model_ready", "1 when the model serves", ["model"], registry=r)
        self.footprint = Gauge("edged_model_footprint_bytes", "Memory a loaded model holds", ["model"], registry=r)
        self.budget = Gauge("edged_memory_budget_bytes", "Memory budget for models", registry=r)
        self.dropped = Counter(
            "edged_dropped",
            "Requests dropped before running (expired, busy, no_reply_to)",
            ["model", "reason"],
            registry=r,
        )
        self.builds = Counter("edged_builds", "Engine builds by outcome", ["model", "outcome"], registry=r)
        self.loop_lag = Gauge(
            "edged_loop_lag_max_seconds", "Worst event-loop lateness over the last interval", registry=r
        )
        self.loop_stalls = Counter("edged_loop_stalls", "Event-loop stalls over lifecycle.loop_stall_ms", registry=r)
        self.stats: dict[str, ModelStats] = {}
        self._lock = threading.Lock()
        r.register(_StatsCollector(self))

    def model(self, name: str) -> ModelStats:
        st = self.stats.get(name)
        if st is None:
            with self._lock:
                st = self.stats.setdefault(name, ModelStats())
        return st

    def observe(self, model: str, transport: str, outcome: str, seconds: float) -> None:
        st = self.stats.get(model) or self.model(model)
        st.requests += 1
        key = (transport, outcome)
        st.outcomes[key] = st.outcomes.get(key, 0) + 1
        if outcome != "ok":
            st.failures += 1
            return
        st.latencies.append(seconds)
        st.buckets[bisect.bisect_left(BUCKETS, seconds)] += 1
        st.seconds_sum += seconds

    def render(self) -> bytes:
        text: bytes = generate_latest(self.registry)
        return text
