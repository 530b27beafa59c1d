"""Thread placement of ONNX Runtime sessions: pure slicing logic, and real sessions that accept it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edged.backends.base import LoadOptions
from edged.backends.onnxruntime import OnnxRuntimeBackend
from edged.backends.ort_threads import affinity_config, allowed_cpus, cpu_slices
from edged.demo import make_tiny_mlp


def test_slices_are_disjoint_and_cover_the_cpus() -> None:
    assert cpu_slices(list(range(16)), 1) == [list(range(16))]
    assert cpu_slices(list(range(16)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    # A restricted CPU set (systemd CPUAffinity=, taskset) is what gets split, not the machine.
    assert cpu_slices([2, 3, 6, 7, 9], 2) == [[2, 3], [6, 7]]


def test_more_instances_than_cpus_share_slices_round_robin() -> None:
    assert cpu_slices([0, 1], 3) == [[0], [1], [0]]
    assert cpu_slices([5], 2) == [[5], [5]]


def test_affinity_names_one_cpu_per_pool_thread_one_based() -> None:
    # 4 CPUs: the calling thread plus 3 pool threads pinned to CPUs 1, 2, 3 (ids 2, 3, 4).
    assert affinity_config([0, 1, 2, 3]) == "2;3;4"
    assert affinity_config([4, 5]) == "6"
    assert affinity_config([7]) == ""


@pytest.mark.parametrize("instances", [1, 2, 3])
def test_sessions_load_and_run_with_their_slices(tmp_path: Path, instances: int) -> None:
    model = make_tiny_mlp(tmp_path / "tiny.onnx")
    backend = OnnxRuntimeBackend(model, LoadOptions(instances=instances))
    backend.load()
    try:
        runners = [backend.instance() for _ in range(instances)]
        x = np.ones((1, 16), np.float32)
        outs = [r.infer({"x": x}) for r in runners]
        assert all(o["probs"].shape == (1, 4) for o in outs)
        for out in outs[1:]:
            np.testing.assert_array_equal(out["probs"], outs[0]["probs"])
    finally:
        backend.unload()
    assert len(allowed_cpus()) >= 1
