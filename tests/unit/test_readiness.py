"""Readiness and the summary line over a real registry whose model states are set by hand."""

from __future__ import annotations

from pathlib import Path

from edged.cache.store import EngineCache
from edged.config import from_mapping
from edged.host.memory import probe_meminfo
from edged.lifecycle.readiness import summary, unready
from edged.quantize.runner import BuildRunner
from edged.serving.metrics import Metrics
from edged.serving.registry import Registry
from edged.serving.states import ModelState


def registry(tmp_path: Path) -> Registry:
    models = {"a": {"path": "a.onnx"}, "b": {"path": "b.onnx"}, "lz": {"path": "l.onnx", "preload": "lazy"}}
    cfg = from_mapping({"models": models}, base=tmp_path)
    return Registry(cfg, EngineCache(tmp_path), BuildRunner(cfg.build, probe_meminfo), Metrics(), 1 << 30)


def test_ready_needs_every_boot_model_settled_and_one_serving(tmp_path: Path) -> None:
    reg = registry(tmp_path)
    a, b = reg.models["a"], reg.models["b"]
    assert unready(reg) == "a is pending; b is pending"
    a.state, b.state = ModelState.READY, ModelState.BUILDING
    assert unready(reg) == "b is building"
    b.state, b.reason = ModelState.FAILED, "model file b.onnx does not exist"
    assert unready(reg) == ""  # degraded, with its reason in the summary
    assert summary(reg, []) == "1 models ready, 1 failed: model file b.onnx does not exist"
    a.state, a.reason = ModelState.DEFERRED, "budget: needs 2 GiB"
    assert unready(reg) == "no boot model serves"  # 0 models ready is not ready


def test_summary_says_what_serves_while_an_engine_builds_and_keeps_a_reload_failure(tmp_path: Path) -> None:
    reg = registry(tmp_path)
    a, b = reg.models["a"], reg.models["b"]
    a.state, a.reason = ModelState.READY, "serving on onnxruntime fp32 while building tensorrt int8 (43%)"
    b.state = ModelState.BUILDING
    text = summary(reg, [b], "models.b.path: required key is missing")
    assert text == (
        "1 models ready (a serving on onnxruntime fp32 while building tensorrt int8 (43%)), 1 building"
        "; reload failed: models.b.path: required key is missing"
    )
