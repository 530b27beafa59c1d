"""Intra-op threads at warm-up: a count the configuration leaves open is the daemon's to measure
(edged/serving/threadpick.py), one it sets is kept; the status says which each model runs with."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from edged.backends.onnxruntime import ort_session
from tests.helpers import DaemonProcess

pytestmark = pytest.mark.integration


def test_the_status_says_the_threads_each_model_runs_with(
    daemon_factory: Callable[..., DaemonProcess], model_dir: Path
) -> None:
    cores = len(os.sched_getaffinity(0))
    d = daemon_factory(
        {
            "tiny": {"path": str(model_dir / "tiny.onnx"), "backend": "onnxruntime"},
            "tiny_b": {"path": str(model_dir / "tiny_b.onnx"), "backend": "onnxruntime", "threads": 3},
        },
    ).start()
    x = np.random.default_rng(1).random((1, 16), dtype=np.float32)
    with d.client() as c:
        models = c.status()["models"]
        assert models["tiny_b"]["threads"] == 3  # configured: never measured
        assert 1 <= models["tiny"]["threads"] <= cores, models["tiny"]
        got = c.infer("tiny", {"x": x})["probs"]
    want = ort_session(str(model_dir / "tiny.onnx")).run(["probs"], {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    log = d.log()
    assert "model=tiny_b" not in "".join(line for line in log.splitlines() if "intra-op threads:" in line)
    if cores > 1 and models["tiny"]["threads"] < cores:
        assert f"intra-op threads: {models['tiny']['threads']} (measured at warm-up" in log
