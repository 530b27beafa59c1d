"""Refused bundles, told three ways: the latest refusal of each model for the status, a
Prometheus counter with the refusal's code as its ``reason`` label, and an event for MQTT.

The agent records a refusal where ``open_bundle`` raised it, on a worker thread: every method
here is thread-safe, and ``publish`` is called on the recording thread (the agent hands the
event to the event loop, ``edged.thread_to_loop``). The counter is registered on the daemon's
own registry (``Metrics.registry``), so ``/metrics`` renders it with the rest, and every code
has a zero sample from the first scrape so that an alert on its rate works from the start.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from edged.fleet.bundle_base import REFUSAL_CODES, BundleRefused
from edged.ratelog import RateLimitedLog

log = logging.getLogger(__name__)
EVENT = "bundle_refused"


@dataclass(frozen=True)
class Refusal:
    model: str  # the model the bundle was meant for ("" when not known yet)
    version: str  # the version it claimed or was desired at ("" when not known)
    code: str  # one of REFUSAL_CODES
    reason: str  # names the file or the key
    source: str  # the bundle's URL or path
    at: float  # Unix time

    def event(self) -> dict[str, Any]:
        """The MQTT event's JSON body."""
        return {"event": EVENT, **asdict(self)}


class Refusals:
    def __init__(
        self,
        registry: CollectorRegistry,
        publish: Callable[[Refusal], None] | None = None,
        keep: int = 256,
    ) -> None:
        self._counter = Counter(
            "edged_fleet_bundle_refusals", "Bundles refused before anything was built", ["reason"], registry=registry
        )
        for code in REFUSAL_CODES:
            self._counter.labels(code)
        self._publish = publish
        # Bounded: model names come from a desired state that a broker user can write.
        self._keep = keep
        self._latest: OrderedDict[str, Refusal] = OrderedDict()
        self._lock = threading.Lock()
        self._ratelog = RateLimitedLog(log)

    def record(self, err: BundleRefused, *, model: str, source: str, version: str = "") -> Refusal:
        code = err.code
        if code not in REFUSAL_CODES:  # a label of its own would grow the metric without bound
            raise ValueError(f"refusal code {code!r} is not one of REFUSAL_CODES")
        refusal = Refusal(model, version, code, err.reason, source, time.time())
        self._counter.labels(code).inc()
        with self._lock:
            self._latest.pop(model, None)
            self._latest[model] = refusal
            while len(self._latest) > self._keep:
                self._latest.popitem(last=False)
        self._ratelog.note(
            logging.WARNING,
            f"refused:{code}",
            "refused bundle %s for %s %s: %s",
            source,
            model or "?",
            version,
            err.reason,
            extra={"model": model, "phase": "bundle"},
        )
        if self._publish is not None:
            try:
                self._publish(refusal)
            except Exception:  # the event is best effort; the status and the counter have it
                log.exception("cannot publish the refusal of %s", source, extra={"model": model, "phase": "bundle"})
        return refusal

    def clear(self, model: str) -> None:
        """A bundle for ``model`` opened since: its refusal is history."""
        with self._lock:
            self._latest.pop(model, None)

    def status(self) -> dict[str, dict[str, Any]]:
        """The latest refusal of each model, for ``/v2/edged/status``."""
        with self._lock:
            return {m: {k: v for k, v in asdict(r).items() if k != "model"} for m, r in self._latest.items()}
