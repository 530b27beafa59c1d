"""The daemon the MQTT protocol tests share, one per test module: its models (``tiny``, a lazy
copy, and ``slow``/``slowq``, a model slow enough to fill a queue or outlive a message expiry), the
module-scoped ``edge`` daemon on the module's broker, and a ``peer`` client per test.

A module using ``edge`` imports ``edge``, ``mqtt_models``, ``peer`` and
``tests.integration.mosquitto.module_broker`` so that pytest finds them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edged.tools.demo import make_tiny_mlp, save_graph
from tests.integration.mosquitto import Broker, Peer
from tests.integration.mqtt_daemon import Edged

# --- models ------------------------------------------------------------------------------------


def make_slow_model(path: Path, size: int = 384, rounds: int = 40) -> Path:
    """Input 'x' FP32 [1,16], output 'probs' [1,4], tens of milliseconds of MatMuls on one
    thread: long enough to fill a queue or outlive a message expiry, from 600 KB of weights."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    a = numpy_helper.from_array((rng.standard_normal((size, size)) / np.sqrt(size)).astype(np.float32), "a")
    b = numpy_helper.from_array(rng.standard_normal((size, 4)).astype(np.float32), "b")
    reps = numpy_helper.from_array(np.array([size, size // 16], np.int64), "reps")
    nodes = [helper.make_node("Tile", ["x", "reps"], ["m0"])]
    for i in range(rounds):
        nodes += [
            helper.make_node("MatMul", [f"m{i}", "a"], [f"p{i}"]),
            helper.make_node("Tanh", [f"p{i}"], [f"m{i + 1}"]),
        ]
    nodes += [
        helper.make_node("ReduceMean", [f"m{rounds}"], ["r"], axes=[0], keepdims=1),
        helper.make_node("MatMul", ["r", "b"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "slow",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [1, 4])],
        [a, b, reps],
    )
    save_graph(graph, path, opset=13)
    return path


# --- fixtures ----------------------------------------------------------------------------------

DEV = "dev-a"


@pytest.fixture(scope="module")
def mqtt_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("models")
    make_tiny_mlp(d / "tiny.onnx")
    make_slow_model(d / "slow.onnx")
    return d


def model_table(mqtt_models: Path) -> dict[str, dict[str, Any]]:
    slow = {"path": str(mqtt_models / "slow.onnx"), "threads": 1, "warmup": {"iterations": 1}}
    return {
        "tiny": {"path": str(mqtt_models / "tiny.onnx")},
        "lazy": {"path": str(mqtt_models / "tiny.onnx"), "preload": "lazy"},
        # One request at a time and no queue: the second concurrent request is 'busy'.
        "slow": dict(slow, queue_depth=1),
        # A deep queue on one thread: a backlog that outlives a message expiry.
        "slowq": dict(slow, queue_depth=64),
    }


@pytest.fixture(scope="module")
def edge(module_broker: Broker, mqtt_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edged]:
    d = tmp_path_factory.mktemp("edge")
    daemon = Edged(
        d, module_broker.port, DEV, model_table(mqtt_models), d / "cache", telemetry_interval_s=1, fleet_group="g"
    )
    daemon.start()
    yield daemon
    assert daemon.stop() == 0


@pytest.fixture
def peer(module_broker: Broker, edge: Edged) -> Iterator[Peer]:
    with Peer(module_broker.port) as p:
        yield p


def socket_probs(edge: Edged, x: np.ndarray) -> np.ndarray:
    with edge.client() as c:
        out: np.ndarray = c.infer("tiny", {"x": x})["probs"]
        return out
