"""Dynamic batching end to end: a real daemon, real ONNX Runtime, concurrent clients on the socket.

The model under test reports the batch it ran in: besides ``y = 2x + 1`` per row, its output
``rows`` holds, on every row, the number of rows of the batch the scheduler handed to ONNX
Runtime. So each answer says both whether it is this request's own result (``y``) and whether it
was batched with others (``rows``), without any timing assumption.

A batch forms only from requests that queue while the model's instance is busy, so the tests
that need one hold the worker with the test-only wedge (edged/lifecycle/faults.py) until every
request is queued, and run the model on its worker (``inline_threshold_us = 0``: a model as
cheap as this one otherwise runs on the event loop, where nothing queues).
"""

from __future__ import annotations

import asyncio
import collections
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from edged import errors
from edged.client import AsyncClient, Client
from edged.serving.batchfit import MARGIN
from edged.tools.demo import save_graph
from tests.helpers import DaemonProcess, while_held

pytestmark = pytest.mark.integration

FEATURES = 4
MAX_BATCH = 8
ON_WORKER = {"server": {"inline_threshold_us": 0}}


def make_probe(path: Path) -> Path:
    """x [N, 4] → y = 2x + 1 [N, 4], rows [N, 1] (every row holds N)."""
    from onnx import TensorProto, helper, numpy_helper

    consts = [
        numpy_helper.from_array(np.array(v, np.float32), n) for n, v in (("two", 2.0), ("one", 1.0), ("zero", 0.0))
    ]
    consts.append(numpy_helper.from_array(np.array([0, 1], np.int64), "first_col"))
    nodes = [
        helper.make_node("Mul", ["x", "two"], ["x2"]),
        helper.make_node("Add", ["x2", "one"], ["y"]),
        # ones [N, 1] from the input itself, summed over the batch axis: N, broadcast back per row
        helper.make_node("Slice", ["x", "slice_start", "slice_end", "slice_axis"], ["col"]),
        helper.make_node("Mul", ["col", "zero"], ["zeros"]),
        helper.make_node("Add", ["zeros", "one"], ["ones"]),
        helper.make_node("ReduceSum", ["ones", "axis0"], ["n"], keepdims=1),
        helper.make_node("Mul", ["ones", "n"], ["rows"]),
    ]
    consts += [
        numpy_helper.from_array(np.array([0], np.int64), "slice_start"),
        numpy_helper.from_array(np.array([1], np.int64), "slice_end"),
        numpy_helper.from_array(np.array([1], np.int64), "slice_axis"),
        numpy_helper.from_array(np.array([0], np.int64), "axis0"),
    ]
    graph = helper.make_graph(
        nodes,
        "batch_probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", FEATURES])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", FEATURES]),
            helper.make_tensor_value_info("rows", TensorProto.FLOAT, ["N", 1]),
        ],
        consts,
    )
    save_graph(graph, path)
    return path


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_probe(tmp_path_factory.mktemp("probe") / "probe.onnx")


async def _fire(socket: str, model: str, payloads: list[np.ndarray]) -> list[dict[str, np.ndarray] | BaseException]:
    """Every payload at once, each on its own connection."""
    clients = [AsyncClient(socket, timeout=30) for _ in payloads]
    try:
        return await asyncio.gather(
            *(c.infer(model, {"x": x}) for c, x in zip(clients, payloads)), return_exceptions=True
        )
    finally:
        for c in clients:
            await c.close()


def _payloads(count: int, rows: Callable[[int], int]) -> list[np.ndarray]:
    """Request i carries rows(i) rows, every value unique to the request."""
    return [
        np.full((rows(i), FEATURES), i, np.float32)
        + np.arange(rows(i) * FEATURES, dtype=np.float32).reshape(rows(i), FEATURES) / 1000
        for i in range(count)
    ]


def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(
    daemon_factory: Callable[..., DaemonProcess], probe: Path, tmp_path: Path
) -> None:
    wedge = tmp_path / "wedge"
    d = daemon_factory(
        {
            "probe": {
                "path": str(probe),
                "backend": "onnxruntime",
                "max_batch": MAX_BATCH,
                "max_queue_delay_us": 50_000,
                "queue_depth": 128,
            }
        },
        extra=ON_WORKER,
        env={"EDGED_TEST_WEDGE": str(wedge)},
    ).start()
    payloads = _payloads(48, lambda i: 1 + i % 3)  # 1, 2 or 3 rows each
    before = _requests(d, "probe")  # the daemon's own warm-up requests count too
    results = while_held(d, wedge, "probe", len(payloads), lambda: asyncio.run(_fire(str(d.socket), "probe", payloads)))

    sizes: collections.Counter[int] = collections.Counter()
    for x, out in zip(payloads, results):
        assert not isinstance(out, BaseException), out
        np.testing.assert_allclose(out["y"], 2 * x + 1, rtol=0, atol=1e-5)  # its own rows, in order
        batch = {int(v) for v in out["rows"].ravel()}
        assert len(batch) == 1, batch
        (n,) = batch
        assert len(x) <= n <= MAX_BATCH
        sizes[n] += len(x)
    # A batch of n rows is made of whole requests: the rows reported as "in a batch of n" add up
    # to a multiple of n; and with 48 requests in flight at once, some batches held several.
    assert all(total % n == 0 for n, total in sizes.items()), sizes
    assert max(sizes) > 3, f"no batch ever held more than one request: {sizes}"

    model = _status(d, "probe")
    assert model["requests"] - before == len(payloads)
    assert not model["inline"]
    assert model["batching"]["on"] and model["batching"]["rows"] == MAX_BATCH, model["batching"]
    assert model["batch_waits"] == 0  # no preferred sizes: a batch is what queued, never a wait
    runs = {b["batch_size"]: b["compute_infer"]["count"] for b in _stats(d, "probe")["batch_stats"]}
    assert max(runs) > 1 and sum(n * k for n, k in runs.items()) == sum(len(x) for x in payloads), runs


def test_a_lone_request_never_waits_out_the_queue_delay(
    daemon_factory: Callable[..., DaemonProcess], probe: Path
) -> None:
    """A request that finds the model's instance idle runs at once, alone, whatever the queue
    delay and the preferred sizes: with a 30 s delay and a 5 s deadline, a batcher that waited
    for company would answer each of these 504."""
    d = daemon_factory(
        {
            "probe": {
                "path": str(probe),
                "backend": "onnxruntime",
                "max_batch": MAX_BATCH,
                "preferred_batch": [4, MAX_BATCH],
                "max_queue_delay_us": 30_000_000,
                "timeout_ms": 5_000,
            }
        },
        extra=ON_WORKER,
    ).start()
    x = np.ones((1, FEATURES), np.float32)
    with Client(str(d.socket)) as c:
        for _ in range(3):
            out = c.infer("probe", {"x": x})
            np.testing.assert_allclose(out["y"], 2 * x + 1, rtol=0, atol=1e-5)
            assert out["rows"].ravel().tolist() == [1.0]  # the batch it ran in held it alone
    model = _status(d, "probe")
    assert model["batching"]["on"] and not model["inline"], model
    assert model["batch_waits"] == 0  # the scheduler's own record: no batch waited for company
    stats = _stats(d, "probe")
    runs = [(b["batch_size"], b["compute_infer"]["count"]) for b in stats["batch_stats"]]
    assert runs == [(1, 3)] and stats["inference_stats"]["success"]["count"] == 3


def test_requests_that_cannot_share_a_batch_do_not_wait_for_company(
    daemon_factory: Callable[..., DaemonProcess], probe: Path
) -> None:
    """Requests of 5 rows with max_batch 8: no two fit one batch. A worker that sees the next
    compatible request cannot fit runs what it has instead of waiting out the 1 s queue delay for
    each one (which would push most of 20 such requests past their 3 s deadline). Only the last,
    with nothing behind it, waits the delay out."""
    d = daemon_factory(
        {
            "probe": {
                "path": str(probe),
                "backend": "onnxruntime",
                "max_batch": MAX_BATCH,
                "max_queue_delay_us": 1_000_000,
                "timeout_ms": 3_000,
                "queue_depth": 128,
            }
        }
    ).start()
    payloads = _payloads(20, lambda i: 5)
    before = _requests(d, "probe")
    results = asyncio.run(_fire(str(d.socket), "probe", payloads))
    ok = late = 0
    for x, out in zip(payloads, results):
        if isinstance(out, errors.DeadlineExceededError):
            late += 1
            continue
        assert not isinstance(out, BaseException), out
        np.testing.assert_allclose(out["y"], 2 * x + 1, rtol=0, atol=1e-5)
        ok += 1
    assert ok + late == len(payloads)
    assert late == 0, f"{late} requests waited for company that could not join their batch"
    with Client(str(d.socket)) as c:
        out = c.status()["models"]["probe"]
    assert out["state"] == "ready" and out["requests"] - before == len(payloads)


def _status(d: DaemonProcess, model: str) -> dict[str, Any]:
    with Client(str(d.socket)) as c:
        return dict(c.status()["models"][model])


def _stats(d: DaemonProcess, model: str) -> dict[str, Any]:
    """The model's Triton statistics (the daemon's warm-up requests are not in them)."""
    with Client(str(d.socket)) as c:
        status, body, _ = c.request("GET", f"/v2/models/{model}/stats")
    assert status == 200, body
    (one,) = orjson.loads(body)["model_stats"]
    return dict(one)


def _requests(d: DaemonProcess, model: str) -> int:
    return int(_status(d, model)["requests"])


def test_the_batching_decision_shows_in_status_with_the_figures_it_rests_on(
    daemon_factory: Callable[..., DaemonProcess], probe: Path, model_dir: Path
) -> None:
    """On a worker a batched model is measured at warm-up: its status says whether batches form,
    of how many rows at most, and the runs' costs that decided it, which agree with the decision."""
    d = daemon_factory(
        {
            "probe": {"path": str(probe), "backend": "onnxruntime", "max_batch": MAX_BATCH},
            "tiny": {"path": str(model_dir / "tiny.onnx"), "backend": "onnxruntime"},
        },
        extra=ON_WORKER,
    ).start()
    fit = _status(d, "probe")["batching"]
    assert set(fit) == {"on", "rows", "measured", "reason", "runs_us", "gains"} and fit["measured"], fit
    runs = {int(n): us for n, us in fit["runs_us"].items()}
    gain = {int(n): g for n, g in fit["gains"].items()}
    assert 1 in runs and set(runs) - {1} == set(gain) and max(runs) <= MAX_BATCH, fit
    assert fit["on"] == (fit["rows"] > 1), fit
    if fit["on"]:  # the largest size that helped, by the margin
        assert gain[fit["rows"]] >= MARGIN and all(g < MARGIN for n, g in gain.items() if n > fit["rows"]), fit
    else:
        assert fit["rows"] == 1 and all(g < MARGIN for g in gain.values()), fit
    shown = subprocess.run(
        [sys.executable, "-m", "edged", "status", "--socket", str(d.socket)], capture_output=True, text=True, check=True
    ).stdout
    what = f"batches of at most {fit['rows']} rows" if fit["on"] else "unbatched"
    assert f"probe: {what}: {fit['reason']}" in shown.splitlines(), shown
    assert "tiny: " not in shown  # a model that does not batch says nothing of it
    assert _status(d, "tiny")["batching"] == {
        "on": False,
        "rows": 1,
        "measured": False,
        "reason": "max_batch is 1",
        "runs_us": {},
        "gains": {},
    }


def test_a_batched_model_cheap_enough_for_the_event_loop_runs_there_unbatched(
    daemon_factory: Callable[..., DaemonProcess], probe: Path
) -> None:
    """Nothing queues behind a model that runs on the event loop, so it never batches: it is not
    measured, and it answers at once, as the same model without max_batch would."""
    d = daemon_factory(
        {"probe": {"path": str(probe), "backend": "onnxruntime", "max_batch": MAX_BATCH, "max_queue_delay_us": 1000}}
    ).start()
    model = _status(d, "probe")
    assert model["inline"] and not model["batching"]["on"] and not model["batching"]["measured"], model
    assert "event loop" in model["batching"]["reason"]
    with Client(str(d.socket)) as c:
        out = c.infer("probe", {"x": np.ones((3, FEATURES), np.float32)})  # a request's own rows still run whole
    assert out["rows"].ravel().tolist() == [3.0, 3.0, 3.0]
    stats = _stats(d, "probe")
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in stats["batch_stats"]] == [(3, 1)]
    assert stats["inference_count"] == 3 and stats["execution_count"] == 1
