"""Every TensorRT name the backend touches exists in every release it can run on (the walk of
tensorrt_api_walk.py over ``edged/backends/tensorrt/``); and the check itself: an unguarded name
a release lacks fails it, a name under its version check passes, a guard for the wrong releases
does not count."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.unit.tensorrt_api_walk import MODULE, PACKAGE, missing, package_uses


def test_every_tensorrt_name_edged_touches_exists_where_it_can_run() -> None:
    uses = package_uses(PACKAGE)
    assert missing(uses) == []
    seen = {(u.owner, u.name) for u in uses}
    # The walk sees what it is meant to: the inference path, the build, the guarded names.
    for owner, name in [
        ("IExecutionContext", "execute_async_v3"),
        ("IExecutionContext", "set_tensor_address"),
        ("IExecutionContext", "set_optimization_profile_async"),
        ("ICudaEngine", "device_memory_size_v2"),
        ("ICudaEngine", "device_memory_size"),
        ("ICudaEngine", "get_tensor_profile_shape"),
        ("Builder", "num_DLA_cores"),
        ("IBuilderConfig", "builder_optimization_level"),
        ("IBuilderConfig", "int8_calibrator"),
        ("IBuilderConfig", "set_timing_cache"),
        ("ITimingCache", "serialize"),
        ("IOptimizationProfile", "set_shape"),
        ("OnnxParser", "parse_from_file"),
        ("BuilderFlag", "INT8"),
        ("NetworkDefinitionCreationFlag", "EXPLICIT_BATCH"),
        ("PreviewFeature", "PROFILE_SHARING_0806"),
        ("DataType", "name"),
        (MODULE, "IInt8EntropyCalibrator2"),
        (MODULE, "__version__"),
    ]:
        assert (owner, name) in seen, (owner, name)
    guarded = {(u.owner, u.name): u.releases for u in uses}
    assert guarded[("ICudaEngine", "device_memory_size")] == {"8.5", "8.6"}
    assert guarded[("BuilderFlag", "INT8")] == {"8.5", "8.6", "10.3", "10.13"}
    assert guarded[("IBuilderConfig", "builder_optimization_level")] == {"8.6", "10.3", "10.13", "11.0", "11.1"}


def _copy_with(tmp_path: Path, file: str, anchor: str, lines: str) -> Path:
    """The package copied, with ``lines`` (indented as ``anchor``) after ``anchor`` in ``file``."""
    copy = tmp_path / "tensorrt"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    source = (copy / file).read_text()
    assert anchor in source
    indent = anchor[: len(anchor) - len(anchor.lstrip())]
    added = "".join(f"{indent}{line}\n" for line in lines.splitlines())
    (copy / file).write_text(source.replace(anchor + "\n", anchor + "\n" + added, 1))
    return copy


CONFIGURE = "    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, opts.workspace)"
PARSER = "    parser = trt.OnnxParser(network, get_logger())"


@pytest.mark.parametrize(
    "anchor, lines, lacking",
    [
        # 11.x only: OnnxParser.set_builder_config arrived in 11.0
        (
            PARSER,
            "parser.set_builder_config(None)",
            "OnnxParser.set_builder_config is not in TensorRT 8.5, 8.6, 10.3, 10.13",
        ),
        # 11.1 only, through the config a function is handed
        (
            CONFIGURE,
            "config.build_route = None",
            "IBuilderConfig.build_route is not in TensorRT 8.5, 8.6, 10.3, 10.13, 11.0",
        ),
        # removed in 11: the implicit INT8 calibrator
        (CONFIGURE, "config.int8_calibrator = None", "IBuilderConfig.int8_calibrator is not in TensorRT 11.0, 11.1"),
        # missing in 8.5: the optimisation level arrived in 8.6
        (CONFIGURE, "config.builder_optimization_level = 3", "builder_optimization_level is not in TensorRT 8.5"),
        # a module name, through a chain: trt.BuilderFlag.FP16 is gone in 11
        (CONFIGURE, "config.set_flag(trt.BuilderFlag.FP16)", "BuilderFlag.FP16 is not in TensorRT 11.0, 11.1"),
        # inside a comprehension, on a value a stub's return type names
        (
            PARSER,
            "ranges = [r for r in network.get_input(0).dynamic_range]",
            "ITensor.dynamic_range is not in TensorRT 11.0, 11.1",
        ),
    ],
)
def test_an_unguarded_name_a_release_lacks_fails_the_check(
    tmp_path: Path, anchor: str, lines: str, lacking: str
) -> None:
    copy = _copy_with(tmp_path, "build.py", anchor, lines)
    found = missing(package_uses(copy))
    assert len(found) == 1 and found[0].endswith(lacking), found


@pytest.mark.parametrize(
    "anchor, lines",
    [
        (PARSER, "if not has_weak_typing(plan.version):\n    parser.set_builder_config(None)"),
        (PARSER, "route = parser.set_builder_config(None) if not has_weak_typing(plan.version) else None"),
        (CONFIGURE, "if has_weak_typing(plan.version) and plan.calibrator:\n    config.int8_calibrator = None"),
        (CONFIGURE, "if not has_optimization_level(plan.version):\n    return\nconfig.builder_optimization_level = 3"),
    ],
)
def test_a_name_under_its_version_check_passes(tmp_path: Path, anchor: str, lines: str) -> None:
    copy = _copy_with(tmp_path, "build.py", anchor, lines)
    assert missing(package_uses(copy)) == []


def test_a_guard_for_the_wrong_releases_does_not_count(tmp_path: Path) -> None:
    lines = "if has_weak_typing(plan.version):\n    parser.set_builder_config(None)"
    found = missing(package_uses(_copy_with(tmp_path, "build.py", PARSER, lines)))
    assert len(found) == 1 and "set_builder_config is not in TensorRT 8.5, 8.6, 10.3, 10.13" in found[0]
