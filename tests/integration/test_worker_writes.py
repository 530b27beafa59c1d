"""Outputs bound for shared memory on a model that runs on its worker thread (the worker writes
them right after the run, edged/transports/shm/worker_writes.py): both kinds of region, several
outputs into one region, a region too small, and a frame-sized answer, on a real daemon."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import orjson
import pytest

from edged.client import Client, MemfdRegion, ShmRegion
from tests.helpers import DaemonProcess

pytestmark = pytest.mark.integration


def reference(model: Path, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


@pytest.fixture(params=[MemfdRegion, ShmRegion], ids=["memfd", "posix"])
def on_worker(
    request: pytest.FixtureRequest, daemon_factory: Callable[..., DaemonProcess], model_dir: Path
) -> tuple[DaemonProcess, type]:
    # inline_threshold_us = 0: no model runs on the loop, every request goes to its worker.
    server = {"inline_threshold_us": 0, "memfd_socket": request.param is MemfdRegion}
    return daemon_factory({"tiny": {"path": str(model_dir / "tiny.onnx")}}, {"server": server}).start(), request.param


def infer(c: Client, doc: dict[str, Any]) -> tuple[int, Any]:
    status, data, _ = c.request(
        "POST", "/v2/models/tiny/infer", orjson.dumps(doc), {"Content-Type": "application/json"}
    )
    return status, orjson.loads(data)


def to_region(region: str, offset: int, size: int) -> dict[str, Any]:
    return {
        "name": "probs",
        "parameters": {"shared_memory_region": region, "shared_memory_offset": offset, "shared_memory_byte_size": size},
    }


def test_a_worker_run_writes_its_answer_into_either_kind_of_region(
    on_worker: tuple[DaemonProcess, type], model_dir: Path
) -> None:
    daemon, kind = on_worker
    rng = np.random.default_rng(3)
    with daemon.client() as c:
        out = c.shm_region("out", 1 << 17)
        assert isinstance(out, kind)
        # The region's 70000 bytes given (the worker writes outputs that may be that large), of
        # which up to 64 rows of 4 floats (1 KiB) are used, at offset 1024.
        for rows in (1, 7, 64):
            x = rng.standard_normal((rows, 16)).astype(np.float32)
            doc = {
                "inputs": [{"name": "x", "shape": [rows, 16], "datatype": "FP32", "data": x.ravel().tolist()}],
                "outputs": [to_region("out", 1024, 70000)],
            }
            status, answer = infer(c, doc)
            assert status == 200, answer
            assert answer["outputs"][0]["parameters"] == {
                "shared_memory_region": "out",
                "shared_memory_byte_size": rows * 16,
            }
            got = out.read(np.float32, (rows, 4), offset=1024)
            np.testing.assert_allclose(got, reference(model_dir / "tiny.onnx", x), rtol=1e-5, atol=1e-6)


def test_a_region_too_small_is_the_same_error_and_writes_nothing(on_worker: tuple[DaemonProcess, type]) -> None:
    with on_worker[0].client() as c:
        out = c.shm_region("out", 1 << 17)
        rows = 8192  # 128 KiB of answer, more than its 70000 bytes
        x = np.ones((rows, 16), np.float32)
        doc = {
            "inputs": [c.shm_region("in", x.nbytes).put(x).meta("x")],
            "outputs": [to_region("out", 0, 70000)],
        }
        status, answer = infer(c, doc)
        assert status == 400 and "needs 131072 bytes, region 'out' was given 70000" in answer["error"], answer
        assert out.read(np.uint8, (1 << 17,)).tobytes() == bytes(1 << 17)
        status, answer = infer(c, {**doc, "outputs": [to_region("nowhere", 0, 1 << 17)]})
        assert status == 400 and "'nowhere' is not registered" in answer["error"], answer


def test_a_deadline_during_a_run_into_the_region_is_answered_once_the_run_is_over(
    daemon_factory: Callable[..., DaemonProcess], model_dir: Path, tmp_path: Path
) -> None:
    """The run writes the client's region itself (256 KiB of answer): a 504 sent while it still
    runs would let the client reuse the region and have this answer land on its next one."""
    wedge = tmp_path / "wedge"
    d = daemon_factory(
        {"tiny": {"path": str(model_dir / "tiny.onnx"), "timeout_ms": 300}},
        {"server": {"inline_threshold_us": 0}},
        env={"EDGED_TEST_WEDGE": str(wedge)},
    ).start()
    rows = 16384
    xs = [np.full((rows, 16), v, np.float32) for v in (0.1, 0.2, 0.3)]
    want = [reference(model_dir / "tiny.onnx", x) for x in xs]
    with d.client() as c:
        out = c.shm_region("out", rows * 16)
        assert isinstance(out, MemfdRegion)

        def ask(x: np.ndarray) -> tuple[int, Any]:
            doc = {
                "inputs": [c.shm_region("in", x.nbytes).put(x).meta("x")],
                "outputs": [to_region("out", 0, rows * 16)],
            }
            return infer(c, doc)

        assert ask(xs[0])[0] == 200  # the output's shape is learnt: the next runs are run into the region
        wedge.touch()
        answered = threading.Event()
        second: list[tuple[int, Any]] = []

        def send() -> None:
            second.append(ask(xs[1]))
            answered.set()

        sender = threading.Thread(target=send)  # the client is used by this thread alone meanwhile
        sender.start()
        try:
            assert not answered.wait(1.5), "the deadline was answered while the run could still write the region"
        finally:
            wedge.unlink()
        assert answered.wait(20)
        sender.join(10)
        assert second[0][0] == 504, second
        np.testing.assert_allclose(out.read(np.float32, (rows, 4)), want[1], rtol=1e-5)  # its run, whole
        assert ask(xs[2])[0] == 200
        np.testing.assert_allclose(out.read(np.float32, (rows, 4)), want[2], rtol=1e-5)
