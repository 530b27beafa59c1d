"""Counters and histograms, rendered as Prometheus text by prometheus_client at scrape time.

The request path only bumps plain integers in a per-model record (a couple of microseconds);
a custom collector turns them into Prometheus families when ``/metrics`` is read. Updating
prometheus_client's labelled metrics on every request took locks and label look-ups that cost
more than the tiny model's whole inference.

Every family has a sample from the first scrape (zero for each model, transport and outcome), so
``rate()`` and alerts work before the first event instead of seeing a series appear from nowhere.
The daemon hands over its model list and queue depths as one callback (``watch``), read at scrape
time, so the figures are the live ones and a model that a reload removes leaves the output.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from edged import errors

BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# The model label of a request for a model edged does not have: a typo in a URL or topic must
# not grow the metrics forever.
UNKNOWN = "_unknown"
DROP_REASONS = ("expired", "busy", "no_reply_to")
BUILD_OUTCOMES = ("ok", "failed")

# `*_created` series double the output and mean nothing to a daemon that restarts with its
# counters; the custom families below never emit them, this covers any prometheus_client metric.
disable_created_metrics()

# Set while the daemon sends its own warm-up requests: they are not traffic.
_UNCOUNTED: contextvars.ContextVar[bool] = contextvars.ContextVar("edged_metrics_uncounted", default=False)


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Requests made inside this block (in this task) are left out of every count."""
    token = _UNCOUNTED.set(True)
    try:
        yield
    finally:
        _UNCOUNTED.reset(token)


def counted() -> bool:
    """False inside ``uncounted()`` (the daemon's warm-up): for other figures kept per request."""
    return not _UNCOUNTED.get()


def request_outcomes() -> tuple[str, ...]:
    """``ok`` and the code of every error a request for a known model can end with."""
    roots: list[type[errors.EdgedError]] = [
        errors.BadRequestError,
        errors.UnavailableError,
        errors.DeadlineExceededError,
        errors.BackendError,
    ]
    codes = {errors.EdgedError.code}  # "internal": an unexpected failure
    while roots:
        cls = roots.pop()
        codes.add(cls.code)
        roots.extend(cls.__subclasses__())
    return ("ok", *sorted(codes))


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


class LabelledValues:
    """A labelled counter or gauge held as plain numbers, with prometheus_client's
    ``labels(...).inc()`` / ``.set()`` calls; rendered by the collector with zero defaults."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, ...], float] = {}

    def labels(self, *values: str) -> _Child:
        return _Child(self.values, values)


class _Child:
    __slots__ = ("_key", "_values")

    def __init__(self, values: dict[tuple[str, ...], float], key: tuple[str, ...]) -> None:
        self._values, self._key = values, key

    def inc(self, amount: float = 1.0) -> None:
        self._values[self._key] = self._values.get(self._key, 0.0) + amount

    def set(self, value: float) -> None:
        self._values[self._key] = value


# Model name -> requests queued or running, read at scrape time.
QueueSource = Callable[[], Mapping[str, int]]


class _StatsCollector(Collector):
    """Runs in whichever thread renders: it reads the loop's figures only through copies that
    CPython makes atomically (``dict(d)``, ``list(x)``), never by iterating a live dict."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        depths = dict(m.queue_depths())
        models = sorted(depths) if m.watching else m.seen_models()
        stats = dict(m.stats)
        yield self._requests(models, stats)
        yield self._latency(models, stats)
        queue = GaugeMetricFamily("edged_queue_depth", "Requests queued or running", labels=["model"])
        ready = GaugeMetricFamily("edged_model_ready", "1 when the model serves", labels=["model"])
        footprint = GaugeMetricFamily("edged_model_footprint_bytes", "Memory a loaded model holds", labels=["model"])
        states, footprints = dict(m.state.values), dict(m.footprint.values)
        for name in models:
            queue.add_metric([name], depths.get(name, 0))
            ready.add_metric([name], states.get((name,), 0.0))
            footprint.add_metric([name], footprints.get((name,), 0.0))
        yield from (queue, ready, footprint)
        dropped = CounterMetricFamily(
            "edged_dropped", "Requests dropped before running (expired, busy, no_reply_to)", labels=["model", "reason"]
        )
        _add_with_defaults(dropped, [*models, UNKNOWN], DROP_REASONS, dict(m.dropped.values))
        yield dropped
        builds = CounterMetricFamily("edged_builds", "Engine builds by outcome", labels=["model", "outcome"])
        _add_with_defaults(builds, models, BUILD_OUTCOMES, dict(m.builds.values))
        yield builds

    def _requests(self, models: list[str], stats: dict[str, ModelStats]) -> Metric:
        m = self._metrics
        reqs = CounterMetricFamily(
            "edged_requests",
            "Inference requests by model, transport and outcome",
            labels=["model", "transport", "outcome"],
        )
        for name in [*models, UNKNOWN]:
            st = stats.get(name)
            seen = dict(st.outcomes) if st is not None else {}
            outcomes = (errors.ModelNotFoundError.code,) if name == UNKNOWN else m.outcomes
            zeros = {(t, o): 0 for t in m.transports for o in outcomes}
            for (transport, outcome), n in sorted({**zeros, **seen}.items()):
                reqs.add_metric([name, transport, outcome], n)
        return reqs

    def _latency(self, models: list[str], stats: dict[str, ModelStats]) -> Metric:
        hist = HistogramMetricFamily(
            "edged_request_seconds", "Inference latency inside the daemon (successful requests)", labels=["model"]
        )
        for name in models:
            st = stats.get(name) or ModelStats()
            cumulative, total = [], 0
            for bound, n in zip((*map(str, BUCKETS), "+Inf"), list(st.buckets)):
                total += n
                cumulative.append((bound, total))
            hist.add_metric([name], cumulative, st.seconds_sum)
        return hist


def _add_with_defaults(
    family: CounterMetricFamily, models: list[str], defaults: tuple[str, ...], values: dict[tuple[str, ...], float]
) -> None:
    """A sample for each model and default label value (zero until counted), and for any other
    value recorded for that model."""
    for name in models:
        extra = sorted({key[1] for key in values if key[0] == name} - set(defaults))
        for value in (*defaults, *extra):
            family.add_metric([name, value], values.get((name, value), 0.0))


# Why the gRPC socket's relay closes a connection (edged/transports/grpc/peers.py).
GRPC_CLOSE_REASONS = ("bodies_in_flight", "read_timeout", "frames_per_read", "answer_not_taken", "no_call")


class Metrics:
    def __init__(self, transports: Iterable[str] = ("http",)) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.budget = Gauge("edged_memory_budget_bytes", "Memory budget for models", registry=r)
        self.state = LabelledValues()  # model -> 1 when it serves
        self.footprint = LabelledValues()  # model -> bytes
        self.dropped = LabelledValues()  # (model, reason) -> count
        self.builds = LabelledValues()  # (model, outcome) -> count
        self.outcomes = request_outcomes()
        self.transports = tuple(transports)
        # The event loop's own latency (edged/lifecycle/loopwatch.py): no model label, a sample from the start.
        self.loop_lag = Gauge(
            "edged_loop_lag_max_seconds", "Worst event-loop lateness over the last interval", registry=r
        )
        self.loop_stalls = Counter("edged_loop_stalls", "Event-loop stalls over lifecycle.loop_stall_ms", registry=r)
        # Connections the gRPC socket's relay closed, by the bound they passed: every reason from
        # the first scrape.
        self.grpc_closed = Counter(
            "edged_grpc_connections_closed",
            "gRPC socket connections closed for passing a bound",
            ["reason"],
            registry=r,
        )
        for reason in GRPC_CLOSE_REASONS:
            self.grpc_closed.labels(reason)
        self.stats: dict[str, ModelStats] = {}
        self._source: QueueSource | None = None
        self._lock = threading.Lock()
        r.register(_StatsCollector(self))

    # --- wiring ---

    def watch(self, source: QueueSource, transports: Iterable[str]) -> None:
        """The daemon's models and their queue depths, read at each scrape, and the transports
        that serve requests (each gets its zero samples)."""
        self._source = source
        self.transports = tuple(transports)

    @property
    def watching(self) -> bool:
        return self._source is not None

    def queue_depths(self) -> Mapping[str, int]:
        return self._source() if self._source is not None else {}

    def seen_models(self) -> list[str]:
        """Without a source (``edged plan``/``build``, tests): every model something was recorded for."""
        names = set(dict(self.stats))
        for family in (self.state, self.footprint, self.builds, self.dropped):
            names |= {key[0] for key in dict(family.values)}
        names.discard(UNKNOWN)
        return sorted(names)

    # --- the request path ---

    def model(self, name: str) -> ModelStats:
        st = self.stats.get(name)
        if st is None:
            with self._lock:
                st = self.stats.setdefault(name, ModelStats())
        return st

    def observe(self, model: str, transport: str, outcome: str, seconds: float) -> None:
        if _UNCOUNTED.get():
            return
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

    def reject(self, model: str, transport: str, code: str, known: bool | None = None) -> None:
        """A request that failed before it reached the model (unknown model, unreadable body):
        counted like any other outcome, under ``_unknown`` when the model does not exist.
        ``known``: whether it does, when the caller knows (else the watched source is asked,
        which builds the daemon's whole model table)."""
        if self._source is not None and not (known if known is not None else model in self._source()):
            model = UNKNOWN
        self.observe(model, transport, code, 0.0)

    def render(self) -> bytes:
        """Prometheus text; safe in any thread, and meant for a worker thread (a few hundred
        samples take milliseconds to format)."""
        text: bytes = generate_latest(self.registry)
        return text
