"""When a new version goes back to the previous one: a pure policy, no I/O.

A version is rolled back when it fails its accuracy gate (the build served another precision
than the bundle asked for, or its gate figures say it failed), when it does not load or warm up,
or when, over its first ``watch_s`` seconds of traffic, its error rate or its p99 latency exceed
the previous version's by more than the configured margins. The traffic verdict waits for
``min_requests`` requests so that one slow or failed request does not decide it; a window that
ends with fewer requests keeps the new version (nothing says it is worse).

A rolled-back (or refused) version is blocked by its desired-state key (version and digest):
it is not tried again until the desired state names another one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Policy:
    watch_s: float = 300.0
    min_requests: int = 50
    max_error_rate_increase: float = 0.02  # absolute: 0.02 = two more failures in a hundred
    max_p99_increase: float = 0.5  # relative: 0.5 = the p99 may grow by half


@dataclass(frozen=True)
class Window:
    """A version's traffic over a stretch of time: counts and its p99 (ms, None: no answer yet)."""

    requests: int
    failures: int
    p99_ms: float | None

    @property
    def error_rate(self) -> float:
        return self.failures / self.requests if self.requests else 0.0


def gate_failure(requested: str, served: str, gate: Mapping[str, Any] | None) -> str | None:
    """Why the built version failed its gate, None when it passed (or had none to pass)."""
    if gate is not None and gate.get("passed") is False:
        figures = ", ".join(
            f"{k} {v:.4g}" for k, v in gate.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
        )
        return f"failed its accuracy gate ({figures or 'no figures'}); serving {served} instead of {requested}"
    if requested != served and requested not in ("auto", ""):
        return f"asked for {requested}, the build serves {served}"
    return None


def traffic_verdict(previous: Window | None, new: Window, policy: Policy) -> str | None:
    """Why ``new`` is worse than ``previous`` by more than the margins, None when it is not (or
    when it has not had ``min_requests`` yet)."""
    if new.requests < policy.min_requests:
        return None
    base_rate = previous.error_rate if previous is not None and previous.requests else 0.0
    if new.error_rate > base_rate + policy.max_error_rate_increase:
        return (
            f"error rate {new.error_rate:.1%} over {new.requests} requests, against {base_rate:.1%} before "
            f"(margin {policy.max_error_rate_increase:.1%})"
        )
    if previous is not None and previous.p99_ms and new.p99_ms is not None:
        limit = previous.p99_ms * (1 + policy.max_p99_increase)
        if new.p99_ms > limit:
            return f"p99 {new.p99_ms:.2f} ms against {previous.p99_ms:.2f} ms before (limit {limit:.2f} ms)"
    return None


def since(now: Window, then: Window, p99_ms: float | None) -> Window:
    """The traffic between two readings of the same cumulative counters."""
    return Window(max(now.requests - then.requests, 0), max(now.failures - then.failures, 0), p99_ms)
