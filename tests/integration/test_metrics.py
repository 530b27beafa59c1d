"""/metrics from the real daemon: every family has samples from the first scrape, warm-up is not
traffic, every outcome is counted (404 and 400 included), queue depth follows the requests in
flight, and promtool accepts the output."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from edged import errors
from edged.serving.metrics import UNKNOWN
from edged.tools.demo import save_graph
from tests.helpers import DaemonProcess, wait_for
from tests.integration.mosquitto import Broker, Peer, broker
from tests.unit.test_metrics import FAMILIES, promtool_check

pytestmark = pytest.mark.integration
__all__ = ["broker"]  # a fixture: imported so that pytest finds it

WIDTH, LAYERS = 256, 40


def make_slow(path: Path) -> Path:
    """x [N, 256] through 40 MatMuls: tens of milliseconds for 64 rows, so requests overlap."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1)
    w = numpy_helper.from_array((rng.standard_normal((WIDTH, WIDTH)) / 16).astype(np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x" if i == 0 else f"h{i}", "w"], [f"h{i + 1}"]) for i in range(LAYERS)]
    nodes.append(helper.make_node("Identity", [f"h{LAYERS}"], ["y"]))
    graph = helper.make_graph(
        nodes,
        "slow",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", WIDTH])],
        [w],
    )
    save_graph(graph, path)
    return path


def scrape(d: DaemonProcess) -> str:
    with d.client() as c:
        status, body, _ = c.request("GET", "/metrics")
    assert status == 200, body
    return body.decode()


def sample(text: str, name: str, **labels: str) -> float:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    raise AssertionError(f"no sample {name}{labels} in:\n{text}")


def outcome(text: str, model: str, result: str) -> float:
    return sample(text, "edged_requests_total", model=model, transport="http", outcome=result)


@pytest.fixture
def daemon(daemon_factory: Callable[..., DaemonProcess], model_dir: Path, tmp_path: Path) -> Iterator[DaemonProcess]:
    d = daemon_factory(
        {
            "tiny": {"path": str(model_dir / "tiny.onnx"), "backend": "onnxruntime"},
            "slow": {"path": str(make_slow(tmp_path / "slow.onnx")), "backend": "onnxruntime", "queue_depth": 64},
        }
    ).start()
    yield d


def test_first_scrape_has_every_family_and_no_warm_up(daemon: DaemonProcess) -> None:
    text = scrape(daemon)
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(fams) >= FAMILIES, set(fams)
    for name in FAMILIES:
        assert fams[name].samples, f"{name} has no sample on the first scrape"
    assert "_created" not in text
    for model in ("tiny", "slow"):
        # the daemon warmed both through the HTTP path before READY=1: none of it is traffic
        for s in fams["edged_requests"].samples:
            if s.labels["model"] == model:
                assert s.value == 0, s
        assert sample(text, "edged_request_seconds_count", model=model) == 0
        assert sample(text, "edged_queue_depth", model=model) == 0
        assert sample(text, "edged_model_ready", model=model) == 1
        assert sample(text, "edged_builds_total", model=model, outcome="failed") == 0
    with daemon.client() as c:
        st = c.status()["models"]["tiny"]
    assert st["requests"] == 0 and st["p50_ms"] is None
    promtool_check(text.encode())


def test_every_outcome_is_counted(daemon: DaemonProcess) -> None:
    x = np.zeros((1, 16), np.float32)
    with daemon.client() as c:
        c.infer("tiny", {"x": x})
        with pytest.raises(errors.ModelNotFoundError):
            c.infer("no-such-model", {"x": x})
        with pytest.raises(errors.InvalidInputError):
            c.infer("tiny", {"x": np.zeros((1, 3), np.float32)})
        status, _, _ = c.request("POST", "/v2/models/tiny/infer", b"{not json", {"Content-Type": "application/json"})
        assert status == 400
        body = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 16], "data": [1.0]}]})
        status, _, _ = c.request("POST", "/v2/models/tiny/infer", body, {"Content-Type": "application/json"})
        assert status == 400
    text = scrape(daemon)
    assert outcome(text, "tiny", "ok") == 1
    assert outcome(text, "tiny", "invalid_input") == 1
    assert outcome(text, "tiny", "bad_request") == 2
    assert outcome(text, UNKNOWN, "model_not_found") == 1
    assert sample(text, "edged_request_seconds_count", model="tiny") == 1
    assert "no-such-model" not in text
    promtool_check(text.encode())


def test_queue_depth_follows_requests_in_flight(daemon: DaemonProcess) -> None:
    stop = threading.Event()
    failures: list[str] = []

    def load() -> None:
        x = np.ones((64, WIDTH), np.float32)
        with daemon.client() as c:
            while not stop.is_set():
                try:
                    c.infer("slow", {"x": x})
                except Exception as e:  # every failure is a finding
                    failures.append(repr(e))
                    return

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        depth = wait_for(
            lambda: sample(scrape(daemon), "edged_queue_depth", model="slow") >= 2, 60, what="queue depth >= 2"
        )
        assert depth
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not failures, failures
    wait_for(lambda: sample(scrape(daemon), "edged_queue_depth", model="slow") == 0, 30, what="queue drained")
    assert sample(scrape(daemon), "edged_queue_depth", model="tiny") == 0


def test_mqtt_outcomes_are_counted_like_the_sockets(
    broker: Broker, daemon_factory: Callable[..., DaemonProcess], model_dir: Path
) -> None:
    d = daemon_factory(
        {"tiny": {"path": str(model_dir / "tiny.onnx"), "backend": "onnxruntime"}},
        extra={"mqtt": {"enabled": True, "host": broker.host, "port": broker.port, "device_id": "m1"}},
    ).start()
    text = scrape(d)
    assert sample(text, "edged_requests_total", model="tiny", transport="mqtt", outcome="bad_request") == 0
    good = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 16], "data": [0.0] * 16}]})
    sent = {b"ok": ("tiny", good), b"unreadable": ("tiny", b"{not json"), b"unknown": ("nope", good)}
    with Peer(broker.port) as peer:
        peer.subscribe("reply/m")
        for corr, (model, payload) in sent.items():
            peer.request(f"edged/m1/models/{model}/infer", payload, "reply/m", corr, "application/json")
        peer.wait(lambda: len(peer.replies("reply/m")) == len(sent), 30, "a reply to every request")
    text = scrape(d)
    mqtt = {
        (model, result): sample(text, "edged_requests_total", model=model, transport="mqtt", outcome=result)
        for model, result in (("tiny", "ok"), ("tiny", "bad_request"), (UNKNOWN, "model_not_found"))
    }
    assert mqtt == {("tiny", "ok"): 1, ("tiny", "bad_request"): 1, (UNKNOWN, "model_not_found"): 1}, mqtt
    assert "nope" not in text
