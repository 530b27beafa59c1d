"""Triton's statistics, model configuration, logging and CUDA shared memory routes, driven with
Triton's own client (``tritonclient.http``) over the TCP listener of a real daemon."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient  # the test-core extra's tritonclient[http]
from tritonclient.utils import InferenceServerException

from tests.helpers import DaemonProcess, wait_for
from tests.integration.mosquitto import Broker, Peer, module_broker
from tests.integration.mqtt_daemon import Edged, json_request
from tests.integration.test_listeners import free_port, tcp

pytestmark = pytest.mark.integration
__all__ = ["module_broker"]  # a fixture: imported so that pytest finds it

BATCH_DELAY_US = 2000
Started = tuple[DaemonProcess, Any, int]
STAGES = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit", "cache_miss")


@pytest.fixture
def triton(daemon_factory: Callable[..., DaemonProcess], model_dir: Path) -> Callable[..., Started]:
    """A daemon with a model that runs alone ("tiny") and one that batches ("batched"), served
    on a TCP port too; returns it started, with a tritonclient on that port, and the port."""

    def make(**server: object) -> Started:
        port = free_port()
        models = {
            "tiny": {"path": str(model_dir / "tiny.onnx")},
            "batched": {
                "path": str(model_dir / "tiny_b.onnx"),
                "max_batch": 4,
                "max_queue_delay_us": BATCH_DELAY_US,
            },
        }
        d = daemon_factory(models, extra={"server": {"tcp": [f"127.0.0.1:{port}"], **server}}).start()
        return d, httpclient.InferenceServerClient(f"127.0.0.1:{port}"), port

    return make


def _infer(client: Any, model: str, rows: int, features: int = 16) -> np.ndarray:
    x = httpclient.InferInput("x", [rows, features], "FP32")
    x.set_data_from_numpy(np.full((rows, features), 0.25, np.float32))
    result: np.ndarray = client.infer(model, [x]).as_numpy("probs")
    return result


def _one(stats: dict[str, Any]) -> dict[str, Any]:
    (model,) = stats["model_stats"]
    return dict(model)


def test_statistics_count_exactly_the_requests_sent(triton: Callable[..., Started]) -> None:
    # Both models on their workers: a model as cheap as these runs on the event loop otherwise,
    # and never waits in a queue.
    _, client, _ = triton(inline_threshold_us=0)
    every = client.get_inference_statistics()
    assert [m["name"] for m in every["model_stats"]] == ["batched", "tiny"]
    for m in every["model_stats"]:  # the daemon's warm-up requests are not counted
        assert m["version"] == "1"
        assert (m["inference_count"], m["execution_count"], m["last_inference"], m["batch_stats"]) == (0, 0, 0, [])
        assert all(m["inference_stats"][s] == {"count": 0, "ns": 0} for s in STAGES)

    before_ms = time.time_ns() // 1_000_000
    for _ in range(5):
        assert _infer(client, "tiny", 1).shape == (1, 4)
    with pytest.raises(InferenceServerException, match="expected shape"):
        _infer(client, "tiny", 1, features=15)
    for _ in range(3):
        assert _infer(client, "batched", 2).shape == (2, 4)

    tiny = _one(client.get_inference_statistics("tiny"))
    st = tiny["inference_stats"]
    assert st["success"]["count"] == 5 and st["fail"]["count"] == 1
    for stage in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert st[stage]["count"] == 5, stage
    for stage in ("success", "fail", "compute_input", "compute_infer", "compute_output"):
        assert st[stage]["ns"] > 0, stage
    # The whole request holds its stages (they are measured inside it).
    parts = sum(st[s]["ns"] for s in ("queue", "compute_input", "compute_infer", "compute_output"))
    assert st["success"]["ns"] >= parts
    assert (tiny["inference_count"], tiny["execution_count"]) == (5, 5)
    assert before_ms <= tiny["last_inference"] <= time.time_ns() // 1_000_000
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in tiny["batch_stats"]] == [(1, 5)]

    batched = _one(client.get_inference_statistics("batched", "1"))
    assert batched == _one(client.get_inference_statistics("batched"))
    bst = batched["inference_stats"]
    assert bst["success"]["count"] == bst["queue"]["count"] == bst["compute_infer"]["count"] == 3
    assert bst["fail"]["count"] == 0
    assert bst["queue"]["ns"] > 0  # a worker picked each request up from the queue
    assert batched["inference_count"] == 6  # rows: each request carried a batch of 2
    runs = batched["batch_stats"]
    assert batched["execution_count"] == sum(b["compute_infer"]["count"] for b in runs) <= 3
    assert sum(b["batch_size"] * b["compute_infer"]["count"] for b in runs) == 6
    assert all(b["compute_infer"]["ns"] > 0 for b in runs)

    assert _one(client.get_inference_statistics("tiny"))["inference_count"] == 5  # reading counts nothing
    with pytest.raises(InferenceServerException, match="Request for unknown model: 'nope' is not found"):
        client.get_inference_statistics("nope")


def test_statistics_exact_json_shape_over_plain_http(triton: Callable[..., Started]) -> None:
    _, client, port = triton()
    _infer(client, "tiny", 1)
    status, data = tcp(port, "GET", "/v2/models/tiny/versions/1/stats")
    assert status == 200
    doc = orjson.loads(data)
    assert list(doc) == ["model_stats"]
    (m,) = doc["model_stats"]
    assert set(m) == {
        "name",
        "version",
        "last_inference",
        "inference_count",
        "execution_count",
        "inference_stats",
        "batch_stats",
    }
    assert set(m["inference_stats"]) == set(STAGES)
    assert all(set(v) == {"count", "ns"} for v in m["inference_stats"].values())
    (batch,) = m["batch_stats"]
    assert set(batch) == {"batch_size", "compute_input", "compute_infer", "compute_output"}
    status, data = tcp(port, "GET", "/v2/models/stats")  # every model, not a model named "stats"
    assert status == 200 and [s["name"] for s in orjson.loads(data)["model_stats"]] == ["batched", "tiny"]
    status, data = tcp(port, "GET", "/v2/models/nope/stats")
    assert (status, orjson.loads(data)["code"]) == (404, "model_not_found")
    assert tcp(port, "POST", "/v2/models/tiny/stats", b"{}")[0] == 405
    extensions = orjson.loads(tcp(port, "GET", "/v2")[1])["extensions"]
    assert {"statistics", "model_configuration", "logging"} <= set(extensions)
    assert "cuda_shared_memory" not in extensions


def test_model_config_in_tritons_shape(triton: Callable[..., Started]) -> None:
    _, client, _ = triton()
    tiny = client.get_model_config("tiny")
    assert (tiny["name"], tiny["platform"], tiny["backend"], tiny["max_batch_size"]) == (
        "tiny",
        "onnxruntime_onnx",
        "onnxruntime",
        0,
    )
    (x,) = tiny["input"]
    assert (x["name"], x["data_type"], x["dims"]) == ("x", "TYPE_FP32", [-1, 16])  # no batching: every dim
    (probs,) = tiny["output"]
    assert (probs["name"], probs["data_type"], probs["dims"]) == ("probs", "TYPE_FP32", [-1, 4])
    assert "dynamic_batching" not in tiny
    assert [(g["kind"], g["count"]) for g in tiny["instance_group"]] == [("KIND_CPU", 1)]

    batched = client.get_model_config("batched", "1")
    assert batched == client.get_model_config("batched")
    assert batched["max_batch_size"] == 4
    assert batched["input"][0]["dims"] == [16] and batched["output"][0]["dims"] == [4]  # batch dim left out
    assert batched["dynamic_batching"]["max_queue_delay_microseconds"] == BATCH_DELAY_US
    assert batched["dynamic_batching"]["preferred_batch_size"] == []
    with pytest.raises(InferenceServerException, match="Request for unknown model: 'nope' is not found"):
        client.get_model_config("nope")


def test_log_settings_round_trip_and_change_the_daemon_log(triton: Callable[..., Started]) -> None:
    d, client, _ = triton()
    assert client.get_log_settings() == {
        "log_file": "",
        "log_info": True,
        "log_warning": True,
        "log_error": True,
        "log_verbose_level": 0,
        "log_format": "default",
    }
    _bad_request(client, "first-quiet")  # a failed request is logged at debug level only
    assert "first-quiet" not in d.log()

    after = client.update_log_settings({"log_verbose_level": 1})
    assert after["log_verbose_level"] == 1 and after["log_info"] is True
    assert client.get_log_settings() == after
    _bad_request(client, "now-logged")
    wait_for(lambda: "now-logged" in d.log(), 10, what="the debug line of a failed request")

    quiet = client.update_log_settings({"log_info": False})  # verbose follows info off
    assert (quiet["log_info"], quiet["log_verbose_level"], quiet["log_warning"]) == (False, 0, True)
    _bad_request(client, "quiet-again")

    refused = {
        "unknown log settings ['log_colour']": {"log_colour": True},
        "'log_info' must be true or false": {"log_info": "yes"},
        "'log_verbose_level' must be a non-negative integer": {"log_verbose_level": True},
        "cannot be combined": {"log_info": True, "log_warning": False},
        "'log_file' cannot be set": {"log_file": "/tmp/triton.log"},
    }
    for message, settings in refused.items():
        with pytest.raises(InferenceServerException, match=message.replace("[", r"\[").replace("]", r"\]")) as e:
            client.update_log_settings(settings)
        assert e.value.status() == "400"
    assert client.get_log_settings() == quiet  # a refused change changes nothing
    assert "quiet-again" not in d.log()


def _bad_request(client: Any, request_id: str) -> None:
    x = httpclient.InferInput("x", [1, 15], "FP32")
    x.set_data_from_numpy(np.zeros((1, 15), np.float32))
    with pytest.raises(InferenceServerException, match="expected shape"):
        client.infer("tiny", [x], request_id=request_id)


def test_log_changes_are_for_admins_when_admin_group_is_set(triton: Callable[..., Started]) -> None:
    d, client, _ = triton(admin_group="root")
    assert client.get_log_settings()["log_verbose_level"] == 0  # reading is for everyone
    with pytest.raises(InferenceServerException, match="only root and members of server.admin_group") as e:
        client.update_log_settings({"log_verbose_level": 1})  # a TCP client has no uid
    assert e.value.status() == "403"
    with d.client() as c:  # root on the Unix socket may
        status, data, _ = c.request("POST", "/v2/logging", b'{"log_verbose_level": 1}')
    assert status == 200 and orjson.loads(data)["log_verbose_level"] == 1
    assert client.get_log_settings()["log_verbose_level"] == 1


def test_cuda_shared_memory_answers_a_clear_error(triton: Callable[..., Started]) -> None:
    _, client, port = triton()
    # What Triton's cudashm example calls before it registers: nothing is registered, and
    # unregistering nothing succeeds.
    assert client.get_cuda_shared_memory_status() == []
    client.unregister_cuda_shared_memory()
    client.unregister_cuda_shared_memory("input0_data")
    with pytest.raises(InferenceServerException, match="system shared memory extension") as e:
        client.register_cuda_shared_memory("input0_data", "AAAA", 0, 64)
    assert e.value.status() == "400"
    body = orjson.dumps({"raw_handle": {"b64": "AAAA"}, "device_id": 0, "byte_size": 64})
    status, data = tcp(port, "POST", "/v2/cudasharedmemory/region/r/register", body)
    assert (status, orjson.loads(data)["code"]) == (400, "cuda_shm_not_supported")
    status, data = tcp(port, "GET", "/v2/cudasharedmemory/region/r/status")
    assert (status, orjson.loads(data)["code"]) == (400, "cuda_shm_not_supported")
    assert tcp(port, "GET", "/v2/cudasharedmemory/region/r/register")[0] == 405
    assert tcp(port, "GET", "/v2/cudasharedmemory/elsewhere")[0] == 404
    assert _infer(client, "tiny", 1).shape == (1, 4)


def test_dynamic_batches_show_in_batch_stats(
    daemon_factory: Callable[..., DaemonProcess], model_dir: Path, tmp_path: Path
) -> None:
    """Requests sent together while the model's worker is busy (held by the test-only wedge,
    edged/lifecycle/faults.py): fewer executions than requests, and each batch size counted with
    the rows it held."""
    port, wedge = free_port(), tmp_path / "wedge"
    models = {"batched": {"path": str(model_dir / "tiny_b.onnx"), "max_batch": 8, "max_queue_delay_us": 300_000}}
    server = {"tcp": [f"127.0.0.1:{port}"], "inline_threshold_us": 0}  # on its worker, which the wedge holds
    d = daemon_factory(models, extra={"server": server}, env={"EDGED_TEST_WEDGE": str(wedge)}).start()
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}", concurrency=8)
    x = httpclient.InferInput("x", [1, 16], "FP32")
    x.set_data_from_numpy(np.ones((1, 16), np.float32))
    wedge.touch()
    try:
        pending = [client.async_infer("batched", [x]) for _ in range(8)]
        with d.client() as c:
            wait_for(lambda: c.status()["models"]["batched"]["queue"] == 8, 30, what="all 8 held by the model")
    finally:
        wedge.unlink(missing_ok=True)
    assert all(p.get_result().as_numpy("probs").shape == (1, 4) for p in pending)
    m = _one(client.get_inference_statistics("batched"))
    runs = {b["batch_size"]: b for b in m["batch_stats"]}
    assert m["inference_count"] == m["inference_stats"]["success"]["count"] == 8
    assert m["execution_count"] == sum(b["compute_infer"]["count"] for b in runs.values()) < 8
    assert sum(size * b["compute_infer"]["count"] for size, b in runs.items()) == 8
    assert max(runs) > 1
    # Joining several requests' inputs is timed too: the batch's own compute_input.
    assert all(b["compute_input"]["ns"] > 0 for size, b in runs.items() if size > 1)


def test_mqtt_requests_are_counted_like_socket_ones(module_broker: Broker, tmp_path: Path, model_dir: Path) -> None:
    d = Edged(
        tmp_path / "edge",
        module_broker.port,
        "dev-s",
        {"tiny": {"path": str(model_dir / "tiny.onnx")}},
        tmp_path / "cache",
    )
    d.start()
    try:
        with Peer(module_broker.port) as peer:
            peer.subscribe("reply/stats")
            for i in range(3):
                peer.request(
                    "edged/dev-s/models/tiny/infer",
                    json_request(np.ones((1, 16), np.float32)),
                    "reply/stats",
                    b"c%d" % i,
                    "application/json",
                )
            peer.wait(lambda: len(peer.replies("reply/stats")) == 3, 10, "three replies")
        with d.client() as c:
            status, data, _ = c.request("GET", "/v2/models/tiny/stats")
        st = _one(orjson.loads(data))["inference_stats"]
        assert status == 200
        for stage in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
            assert st[stage]["count"] == 3, stage
        assert st["compute_input"]["ns"] > 0 and st["compute_output"]["ns"] > 0
    finally:
        assert d.stop() == 0


def test_server_metadata_names_what_the_config_says(triton: Callable[..., Started]) -> None:
    # Triton's health-and-metadata examples exit 1 unless the server calls itself "triton".
    _, client, _ = triton(metadata_name="triton")
    meta = client.get_server_metadata()
    assert meta["name"] == "triton"
    assert "system_shared_memory" in meta["extensions"]
