"""edged.serving.metrics on its own: zero samples from the start, warm-up left out, every outcome counted,
no ``*_created`` series, and output that promtool and prometheus_client's parser accept.

The model list and queue depths come from a plain dict standing in for the daemon's registry (the
integration test in tests/integration/test_metrics.py scrapes the real daemon).
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
from prometheus_client.parser import text_string_to_metric_families

from edged import errors
from edged.serving.metrics import UNKNOWN, Metrics, request_outcomes, uncounted

FAMILIES = {
    "edged_memory_budget_bytes",
    "edged_loop_lag_max_seconds",
    "edged_loop_stalls",
    "edged_requests",
    "edged_request_seconds",
    "edged_queue_depth",
    "edged_model_ready",
    "edged_model_footprint_bytes",
    "edged_dropped",
    "edged_builds",
    "edged_grpc_connections_closed",
}


def samples(m: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def requests(m: Metrics, model: str, transport: str, outcome: str) -> float:
    key = ("edged_requests_total", (("model", model), ("outcome", outcome), ("transport", transport)))
    return samples(m)[key]


def watched(depths: dict[str, int], transports: tuple[str, ...] = ("http", "mqtt")) -> Metrics:
    m = Metrics()
    m.watch(lambda: depths, transports)
    return m


def promtool_check(text: bytes) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: install the Debian package 'prometheus' (scripts/test.sh does)"
    res = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=30)
    assert res.returncode == 0 and not res.stdout.strip() and not res.stderr.strip(), (res.stdout, res.stderr)


def test_every_family_has_samples_before_any_event() -> None:
    m = watched({"a": 0, "b": 0})
    fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    assert set(fams) == FAMILIES
    for fam in fams.values():
        assert fam.samples, f"{fam.name} has no sample"
    got = samples(m)
    for model in ("a", "b"):
        for transport in ("http", "mqtt"):
            for outcome in request_outcomes():
                assert requests(m, model, transport, outcome) == 0
        assert got[("edged_queue_depth", (("model", model),))] == 0
        assert got[("edged_model_ready", (("model", model),))] == 0
        assert got[("edged_request_seconds_count", (("model", model),))] == 0
        assert got[("edged_builds_total", (("model", model), ("outcome", "failed")))] == 0
        assert got[("edged_dropped_total", (("model", model), ("reason", "expired")))] == 0
    assert requests(m, UNKNOWN, "http", "model_not_found") == 0


def test_outcomes_cover_every_request_error() -> None:
    outcomes = set(request_outcomes())
    for cls in (
        errors.BadRequestError,
        errors.InvalidInputError,
        errors.PayloadTooLargeError,
        errors.SharedMemoryNotFoundError,
        errors.ModelNotReadyError,
        errors.BusyError,
        errors.DeadlineExceededError,
        errors.BackendError,
        errors.EdgedError,
    ):
        assert cls.code in outcomes
    assert "ok" in outcomes
    assert errors.ConfigError.code not in outcomes  # not something a request ends with


def test_no_created_series_and_promtool_is_clean() -> None:
    m = watched({"tiny": 3})
    m.observe("tiny", "http", "ok", 0.0004)
    m.builds.labels("tiny", "ok").inc()
    m.dropped.labels("tiny", "busy").inc()
    text = m.render()
    assert b"_created" not in text
    promtool_check(text)


def test_queue_depth_is_read_at_scrape_time() -> None:
    depths = {"tiny": 0}
    m = watched(depths)
    assert samples(m)[("edged_queue_depth", (("model", "tiny"),))] == 0
    depths["tiny"] = 5
    assert samples(m)[("edged_queue_depth", (("model", "tiny"),))] == 5


def test_warm_up_is_not_traffic() -> None:
    m = watched({"tiny": 0})
    with uncounted():
        m.observe("tiny", "http", "ok", 0.001)
        m.reject("tiny", "http", "bad_request")
    assert requests(m, "tiny", "http", "ok") == 0
    assert m.model("tiny").requests == 0 and m.model("tiny").percentiles()["p50_ms"] is None
    m.observe("tiny", "http", "ok", 0.001)
    assert requests(m, "tiny", "http", "ok") == 1


def test_rejections_count_and_unknown_models_share_one_label() -> None:
    m = watched({"tiny": 0})
    m.reject("tiny", "http", "bad_request")
    m.reject("tpyo", "http", "model_not_found")
    m.reject("other-typo", "mqtt", "model_not_found")
    assert requests(m, "tiny", "http", "bad_request") == 1
    assert requests(m, UNKNOWN, "http", "model_not_found") == 1
    assert requests(m, UNKNOWN, "mqtt", "model_not_found") == 1
    assert not any(dict(labels).get("model") in ("tpyo", "other-typo") for _, labels in samples(m))
    # a failed request has no latency: the histogram holds successful requests only
    assert samples(m)[("edged_request_seconds_count", (("model", "tiny"),))] == 0


def test_a_caller_that_knows_whether_the_model_exists_spares_the_model_table() -> None:
    calls = []

    def source() -> dict[str, int]:
        calls.append(1)
        return {"tiny": 0}

    m = Metrics()
    m.watch(source, ("http",))
    m.reject("tiny", "http", "bad_request", known=True)
    m.reject("tpyo", "http", "model_not_found", known=False)
    assert not calls, "the source was read on a rejection whose caller knew the answer"
    assert requests(m, "tiny", "http", "bad_request") == 1
    assert requests(m, UNKNOWN, "http", "model_not_found") == 1


def test_a_model_the_reload_removes_leaves_the_output() -> None:
    depths = {"a": 0, "b": 0}
    m = watched(depths)
    m.observe("b", "http", "ok", 0.001)
    del depths["b"]
    assert not any(dict(labels).get("model") == "b" for _, labels in samples(m))


@pytest.mark.parametrize("transports", [("http",), ("http", "mqtt")])
def test_transports_get_zero_samples(transports: tuple[str, ...]) -> None:
    m = watched({"tiny": 0}, transports)
    seen = {dict(labels)["transport"] for name, labels in samples(m) if name == "edged_requests_total"}
    assert seen == set(transports)
