"""The build pipeline with TensorRT's rules, without TensorRT: the fallback chain comes from what
the backend can build here (TensorRT 11: int8 -> fp32), a failed fallback names its step, every
build and search trial is handed the engine cache (where the device's timing cache lives), and
the cache key carries the build recipe.

The stand-in backends are fakes for this unit test of the pipeline's logic: TensorRT's own
precision rules (``versions.plan_build`` and ``versions.buildable_precisions`` for a given
version) in front of ONNX Runtime's build, so the calibration, the Q/DQ model and the accuracy
gate run for real."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from edged.backends.base import BuildSpec, Progress
from edged.backends.onnxruntime import OnnxRuntimeBackend
from edged.backends.tensorrt.versions import (
    BUILD_RECIPE,
    BuildOptions,
    Version,
    buildable_precisions,
    plan_build,
    read_model_traits,
)
from edged.cache.store import EngineCache, file_digest
from edged.errors import BuildError
from edged.quantize.job import PIPELINE_RECIPE, BuildJob, job_key, key_fields
from edged.quantize.pipeline import build_precision
from edged.tools.selftest_checks import failed_step

NEVER_PASSES = {"holdout": 0.25, "metric": ["rel_l2"], "max_rel_l2": 1e-9, "search": "off"}


class FakeTensorRTRules(OnnxRuntimeBackend):
    """TensorRT's precision rules at ``trt_version``, ONNX Runtime's artefacts (see the module)."""

    name = "fake-tensorrt-rules"
    precisions: ClassVar[tuple[str, ...]] = ("int8", "fp16", "fp32")  # type: ignore[assignment]
    trt_version: ClassVar[Version] = (11, 1, 0)
    built: ClassVar[list[BuildSpec]] = []

    @classmethod
    def buildable_precisions(cls, source: str, options: Any) -> tuple[str, ...]:
        return buildable_precisions(cls.trt_version, read_model_traits(source), BuildOptions.from_mapping(options))

    @classmethod
    def build(cls, spec: BuildSpec, dest: Path, progress: Progress) -> dict[str, Any]:
        cls.built.append(spec)
        opts = BuildOptions.from_mapping(spec.options)
        plan_build(cls.trt_version, spec.precision, opts, read_model_traits(spec.source), spec.source)
        return super().build(spec, dest, progress)


class FakeFallbackOutOfMemory(FakeTensorRTRules):
    """TensorRT 10.3's rules, with the fp16 build running out of memory."""

    name = "fake-fallback-oom"
    trt_version = (10, 3, 0)

    @classmethod
    def build(cls, spec: BuildSpec, dest: Path, progress: Progress) -> dict[str, Any]:
        if spec.precision == "fp16":
            raise BuildError("TensorRT could not build the engine: out of memory")
        return super().build(spec, dest, progress)


@pytest.fixture
def setup(tmp_path: Path) -> dict[str, Any]:
    from edged.tools.demo import make_tiny_mlp

    mlp = make_tiny_mlp(tmp_path / "mlp.onnx")
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for i in range(8):
        np.save(data / f"{i:02}.npy", rng.standard_normal((4, 16), dtype=np.float32))
    cache = EngineCache(tmp_path / "cache")
    cache.prepare()
    FakeTensorRTRules.built.clear()
    return {"mlp": mlp, "data": data, "cache": cache}


def job(setup: dict[str, Any], backend: str, gate: dict[str, Any], options: dict[str, Any] | None = None) -> BuildJob:
    return BuildJob(
        model="mlp",
        source=str(setup["mlp"]),
        precision="int8",
        backend=backend,
        cache_dir=str(setup["cache"].dir),
        source_digest=file_digest(setup["mlp"]),
        options=options or {},
        calibration={"data": str(setup["data"])},
        calibration_digest="d",
        gate=gate,
    )


def test_on_tensorrt_11_int8_falls_back_to_fp32_not_to_an_fp16_it_cannot_build(setup: dict[str, Any]) -> None:
    cls = FakeTensorRTRules
    entry = build_precision(job(setup, cls.name, NEVER_PASSES), cls, setup["cache"], lambda p, f: None)
    assert [s.precision for s in cls.built] == ["int8", "fp32"]
    assert entry.manifest["precision"] == "fp32" and entry.artifact.exists()
    record = setup["cache"].lookup("mlp", job_key(job(setup, cls.name, NEVER_PASSES), cls), cls.artifact_suffix)
    assert record is not None and record.manifest["fallback"] == "fp32"
    assert record.manifest["reason"].endswith("; serving fp32")
    # The next boot goes straight to the fallback the record names: nothing is built again.
    again = build_precision(job(setup, cls.name, NEVER_PASSES), cls, setup["cache"], lambda p, f: None)
    assert again.key == entry.key and len(cls.built) == 2


def test_a_fallback_that_fails_to_build_names_its_step(setup: dict[str, Any]) -> None:
    cls = FakeFallbackOutOfMemory
    phases: list[str] = []
    the_job = job(setup, cls.name, NEVER_PASSES)
    with pytest.raises(BuildError) as failed:
        build_precision(the_job, cls, setup["cache"], lambda phase, f: phases.append(phase))
    text = str(failed.value)
    assert text.startswith("mlp: int8 failed its accuracy gate (failed: ")
    assert "so fp16 was to be served, but building fp16 failed: TensorRT could not build the engine: out of" in text
    record = setup["cache"].lookup("mlp", job_key(the_job, cls), cls.artifact_suffix)
    assert record is not None
    line = failed_step(record.manifest, phases, failed.value)
    assert "rel_l2 0.0" in line and "int8 built but failed its gate (failed: " in line
    assert line.endswith(
        "the fallback fp16 then failed at 'building fp16': TensorRT could not build the engine: out of memory"
    )


def test_an_int8_build_that_fails_is_blamed_on_int8_at_its_step() -> None:
    error = BuildError("TensorRT cannot parse q.onnx: unsupported op")
    line = failed_step(None, ["parsing", "calibrating", "building int8"], error)
    assert line == "the int8 build failed at 'building int8': TensorRT cannot parse q.onnx: unsupported op"


def test_every_build_and_search_trial_is_handed_the_engine_cache(setup: dict[str, Any]) -> None:
    """A trial's artefact lives in a temporary folder of the search; the timing cache must not be
    looked for beside it (it would start empty and vanish with the folder) but in the cache."""
    cls = FakeTensorRTRules
    gate = dict(NEVER_PASSES, search="auto", max_trials=3)
    build_precision(job(setup, cls.name, gate), cls, setup["cache"], lambda p, f: None)
    trials = [s for s in cls.built if s.options.get("int8_float_nodes")]
    assert trials, [s.options for s in cls.built]  # the search ran trials
    assert {s.cache_dir for s in cls.built} == {str(setup["cache"].dir)}


def test_the_cache_key_carries_the_pipeline_and_backend_recipes(setup: dict[str, Any]) -> None:
    cls = FakeTensorRTRules
    the_job = job(setup, cls.name, NEVER_PASSES)
    assert key_fields(the_job, cls)["recipe"] == {"pipeline": PIPELINE_RECIPE, "backend": cls.build_recipe}

    class Rebuilt(FakeTensorRTRules):
        build_recipe = cls.build_recipe + "-changed"

    assert job_key(the_job, Rebuilt) != job_key(the_job, cls)
    from edged.backends.tensorrt import TensorRTBackend

    assert TensorRTBackend.build_recipe == BUILD_RECIPE != "1"  # its own, not the default of other backends


@pytest.mark.parametrize(
    "version, buildable",
    [("11.1.0", ("int8", "fp32")), ("10.3.0.30", ("int8", "fp16", "fp32")), ("8.5.2.2", ("int8", "fp16", "fp32"))],
)
def test_the_tensorrt_backend_says_what_it_can_build_on_the_installed_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str, buildable: tuple[str, ...]
) -> None:
    from edged.backends.tensorrt import TensorRTBackend
    from edged.tools.demo import make_tiny_mlp

    module = types.ModuleType("tensorrt")
    module.__version__ = version  # type: ignore[attr-defined]  # a fake: the version is all it has
    monkeypatch.setitem(sys.modules, "tensorrt", module)
    mlp = str(make_tiny_mlp(tmp_path / "mlp.onnx"))
    assert TensorRTBackend.buildable_precisions(mlp, {}) == buildable
    if version.startswith("11"):  # the legacy calibrator is gone too: nothing but fp32 is left
        assert TensorRTBackend.buildable_precisions(mlp, {"legacy_calibrator": True}) == ("fp32",)
