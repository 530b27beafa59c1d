"""The mixed-precision search: a model with exactly one node made sensitive by construction is
found within max_trials (real quantization, real ONNX Runtime), and the search's bounds and
bookkeeping on a fake trial function (pure logic)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from edged.backends.base import BuildSpec, LoadOptions, TensorSpec
from edged.backends.onnxruntime import OnnxRuntimeBackend, ort_session
from edged.config import CalibrationConfig, GateConfig
from edged.quantize import search
from edged.quantize.calibrate import CalibrationSet
from edged.quantize.gate import evaluate
from edged.quantize.qdq import prepare, quantize_qdq
from edged.tools.demo import save_graph

WIDTH, DEPTH, SENSITIVE = 16, 8, 5


def chain(path: Path) -> Path:
    """x → (MatMul → Relu) x DEPTH. Before MatMul ``mm5`` one channel is scaled by 1000 and that
    channel's weights by 1/1000: the FP32 result is unchanged, but quantizing mm5's input on a
    range set by the huge channel rounds every other channel to zero. No other node is hurt."""
    rng = np.random.default_rng(1)
    nodes, inits, x = [], [], "x"
    for i in range(DEPTH):
        w = (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
        if i == SENSITIVE:
            scale = np.ones(WIDTH, np.float32)
            scale[0] = 1000.0
            w[0] /= 1000.0
            inits.append(numpy_helper.from_array(scale, "spike"))
            nodes.append(helper.make_node("Mul", [x, "spike"], ["spiked"], name="spike"))
            x = "spiked"
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"], name=f"mm{i}"))
        nodes.append(helper.make_node("Relu", [f"m{i}"], [f"r{i}"], name=f"relu{i}"))
        x = f"r{i}"
    nodes.append(helper.make_node("Identity", [x], ["y"], name="out"))
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", WIDTH])],
        inits,
    )
    return save_graph(graph, path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("search")
    data = work / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for i in range(10):
        np.save(data / f"{i}.npy", np.abs(rng.standard_normal((8, WIDTH))).astype(np.float32))
    samples = CalibrationSet.load(CalibrationConfig(data=str(data)), [TensorSpec("x", "float32", (-1, WIDTH))])
    calib, held = samples.split(0.3)
    return {"work": work, "model": chain(work / "chain.onnx"), "calib": calib, "held": held}


def _judge(setup: dict[str, Any], excluded: list[str], gate: GateConfig) -> dict[str, Any]:
    work: Path = setup["work"]
    tag = "-".join(excluded) or "none"
    qdq = work / f"q-{tag}.onnx"
    quantize_qdq(setup["model"], qdq, setup["calib"], ranges_cache=work / "ranges.json", nodes_to_exclude=excluded)
    artefact = work / f"a-{tag}.onnx"
    OnnxRuntimeBackend.build(BuildSpec(source=str(qdq), precision="int8"), artefact, lambda p, f: None)
    backend = OnnxRuntimeBackend(artefact, LoadOptions(threads=1))
    backend.load()
    ref = ort_session(str(setup["model"]))
    try:
        run = backend.instance().infer
        return evaluate(lambda f: {"y": ref.run(["y"], f)[0]}, run, setup["held"], gate).to_dict()
    finally:
        backend.unload()


def test_the_one_sensitive_node_is_found_within_max_trials(setup: dict[str, Any]) -> None:
    gate = GateConfig(metric=["rel_l2"], max_rel_l2=0.2)  # all-INT8: 1.0; the rest adds ~0.07
    first = _judge(setup, [], gate)
    assert not first["passed"], first  # the construction works: all-INT8 fails
    infos = search.rank(prepare(setup["model"], setup["work"]), setup["work"] / "q-none.onnx", list(setup["calib"])[:4])
    assert infos[0].name == f"mm{SENSITIVE}"
    assert {i.name for i in infos} == {f"mm{i}" for i in range(DEPTH)}
    result = search.search(infos, lambda excl: _judge(setup, excl, gate), max_trials=8, first=first)
    assert result.passed and result.excluded == [f"mm{SENSITIVE}"], result.trials
    assert len(result.trials) == 2 and result.trials[1]["passed"]
    assert result.gate is not None and result.gate["rel_l2"] <= 0.2
    # every MatMul does the same work: 7 of 8 stay INT8
    assert result.int8_mac_fraction == pytest.approx(7 / 8) and result.int8_node_fraction == pytest.approx(7 / 8)


# --- the search's logic, with a fake trial function ------------------------------------------------


def infos(n: int) -> list[search.NodeInfo]:
    return [search.NodeInfo(f"n{i}", "Conv", float(n - i), 100) for i in range(n)]


def fake_trial(needed: int, calls: list[int]) -> search.TrialFn:
    """A fake gate: passes once the ``needed`` most sensitive nodes are excluded."""

    def trial(excluded: list[str]) -> dict[str, Any]:
        calls.append(len(excluded))
        ok = len(excluded) >= needed
        return {"passed": ok, "reason": "fake", "rel_l2": 0.01 if ok else 0.5}

    return trial


@pytest.mark.parametrize("needed", [1, 3, 5, 13])
def test_doubling_then_bisection_finds_the_smallest_k(needed: int) -> None:
    calls: list[int] = []
    result = search.search(infos(20), fake_trial(needed, calls), max_trials=12, first={"passed": False})
    assert result.passed and len(result.excluded) == needed
    assert result.excluded == [f"n{i}" for i in range(needed)]
    assert len(result.trials) == len(calls) + 1 <= 12
    assert result.int8_mac_fraction == pytest.approx((20 - needed) / 20)


def test_the_budget_bounds_the_trials_and_a_miss_is_reported() -> None:
    calls: list[int] = []
    result = search.search(infos(64), fake_trial(60, calls), max_trials=4, first={"passed": False})
    assert not result.passed and result.excluded == [] and result.gate is None
    assert calls == [1, 2, 4] and len(result.trials) == 4
    # a pass with the budget spent before bisection ends keeps the best found so far
    calls = []
    partial = search.search(infos(64), fake_trial(5, calls), max_trials=5, first={"passed": False})
    assert partial.passed and len(partial.excluded) == 8 and calls == [1, 2, 4, 8]


def test_a_failed_search_keeps_the_all_int8_verdict(setup: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from edged.cache.store import EngineCache, file_digest
    from edged.quantize import mixed
    from edged.quantize.job import BuildJob

    cache = EngineCache(setup["work"] / "cache")
    cache.prepare()
    job = BuildJob(
        model="chain",
        source=str(setup["model"]),
        precision="int8",
        backend="onnxruntime",
        cache_dir=str(cache.dir),
        source_digest=file_digest(setup["model"]),
        calibration={"data": str(setup["work"] / "data"), "method": "minmax"},
        gate={"metric": ["rel_l2"], "max_rel_l2": 0.2},
    )
    first = {"passed": False, "reason": "failed: 'y' relative L2 error 1 > 0.2", "rel_l2": 1.0}

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("ranking exploded")

    monkeypatch.setattr(search, "rank", broken)
    found = mixed.mixed_precision(
        job,
        OnnxRuntimeBackend,
        cache,
        setup["calib"],
        first,
        setup["work"] / "t.onnx",
        lambda p, f: None,
        setup["model"],  # stands for the all-INT8 model: the ranking fails before reading it
        lambda qdq, artefact, excluded: pytest.fail("no trial may run when the ranking fails"),
    )
    assert not found.gate["passed"] and found.gate["rel_l2"] == 1.0
    assert "mixed precision: search failed (RuntimeError: ranking exploded)" in found.gate["reason"]
    assert found.extra["mixed_precision"] == {"passed": False, "error": "RuntimeError: ranking exploded"}
