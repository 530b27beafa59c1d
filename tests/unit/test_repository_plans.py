"""A model.plan built elsewhere: served as it is only when the manifest beside it matches this
device's TensorRT and fingerprint; otherwise the model.onnx beside it is built here, or the model
fails saying why."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest

from edged.cache.store import file_digest
from edged.errors import ConfigError, EdgedError
from edged.repository.load import read_repository
from edged.repository.plans import verdict
from tests.repository import ORIN, XAVIER, model_folder, no_tensorrt, plan_with_manifest

PLAN_PBTXT = """platform: "tensorrt_plan"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "probs" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""


def on_orin() -> tuple[str, Mapping[str, str]]:
    return "10.3.0", ORIN


def test_a_plan_without_a_manifest_cannot_show_what_built_it(tmp_path: Path) -> None:
    plan = tmp_path / "model.plan"
    plan.write_bytes(b"engine")
    assert (
        verdict(plan, on_orin)
        == "model.plan has no manifest (model.plan.json) to say which TensorRT, CUDA and GPU built it"
    )


def test_a_plan_for_this_device_is_served_as_it_is(tmp_path: Path) -> None:
    assert verdict(plan_with_manifest(tmp_path / "model.plan", "10.3.0", ORIN), on_orin) == ""


def test_every_difference_from_this_device_is_named(tmp_path: Path) -> None:
    why = verdict(plan_with_manifest(tmp_path / "model.plan", "8.5.2", XAVIER), on_orin)
    assert why.startswith("model.plan was built for another device: TensorRT '8.5.2' (this device: '10.3.0')")
    assert "gpu 'Xavier' (this device: 'Orin')" in why and "compute_capability '7.2' (this device: '8.7')" in why


def test_a_plan_replaced_under_its_manifest_is_not_the_one_it_describes(tmp_path: Path) -> None:
    plan = plan_with_manifest(tmp_path / "model.plan", "10.3.0", ORIN)
    plan.write_bytes(b"another engine")
    assert verdict(plan, on_orin) == "model.plan is not the file model.plan.json describes (its checksum differs)"


def test_without_tensorrt_no_plan_matches_and_it_says_what_built_it(tmp_path: Path) -> None:
    why = verdict(plan_with_manifest(tmp_path / "model.plan", "10.3.0", ORIN), no_tensorrt)
    assert why == (
        "model.plan was built by tensorrt 10.3.0 on Jetson Orin Nano (nvidia,p3767-0005), and this machine has "
        "no usable TensorRT (tensorrt is not installed)"
    )


def test_a_foreign_plan_falls_back_to_the_model_onnx_beside_it(tmp_path: Path) -> None:
    folder = model_folder(tmp_path, "det", PLAN_PBTXT)
    plan_with_manifest(folder / "1" / "model.plan", "8.5.2", XAVIER)
    models, origins = read_repository(tmp_path, on_orin)
    assert (models["det"].path, models["det"].backend) == (str(folder / "1" / "model.onnx"), "auto")
    assert origins["det"].note.startswith("model.plan was built for another device: TensorRT '8.5.2'")
    assert origins["det"].note.endswith("; serving the model.onnx beside it instead, built for this device")


def test_kind_gpu_builds_the_fallback_with_tensorrt(tmp_path: Path) -> None:
    folder = model_folder(tmp_path, "det", PLAN_PBTXT + "instance_group [ { kind: KIND_GPU } ]")
    plan_with_manifest(folder / "1" / "model.plan", "8.5.2", XAVIER)
    models, _ = read_repository(tmp_path, on_orin)
    assert models["det"].backend == "tensorrt"


def test_a_matching_plan_is_the_models_file(tmp_path: Path) -> None:
    folder = model_folder(tmp_path, "det", PLAN_PBTXT)
    plan_with_manifest(folder / "1" / "model.plan", "10.3.0", ORIN)
    models, origins = read_repository(tmp_path, on_orin)
    assert (models["det"].path, models["det"].backend) == (str(folder / "1" / "model.plan"), "tensorrt")
    assert origins["det"].note == "model.plan served as it is: its manifest matches this device"


def test_a_foreign_plan_alone_is_kept_to_fail_with_its_reason(tmp_path: Path) -> None:
    folder = tmp_path / "det"
    plan_with_manifest(folder / "1" / "model.plan", "8.5.2", XAVIER)
    (folder / "config.pbtxt").write_text(PLAN_PBTXT)
    models, origins = read_repository(tmp_path, on_orin)
    assert models["det"].path == str(folder / "1" / "model.plan")
    assert origins["det"].note.endswith("; there is no model.onnx beside it to build from")


def test_kind_cpu_is_refused_for_a_plan(tmp_path: Path) -> None:
    folder = model_folder(tmp_path, "det", PLAN_PBTXT + "instance_group [ { kind: KIND_CPU } ]")
    plan_with_manifest(folder / "1" / "model.plan", "10.3.0", ORIN)
    with pytest.raises(ConfigError, match="KIND_CPU: a TensorRT plan runs on the GPU"):
        read_repository(tmp_path, on_orin)


def test_the_registry_refuses_a_plan_path_whose_manifest_does_not_match(tmp_path: Path) -> None:
    from edged.repository.plans import prebuilt_entry

    class FakeTensorRT:
        name = "tensorrt"

        @classmethod
        def version(cls) -> str:
            return "10.3.0"

        @classmethod
        def fingerprint(cls) -> dict[str, str]:
            return dict(ORIN)

    plan = plan_with_manifest(tmp_path / "model.plan", "10.3.0", ORIN)
    entry = prebuilt_entry(str(plan), FakeTensorRT, file_digest)  # type: ignore[arg-type]
    assert (entry.key, entry.artifact, entry.manifest["precision"]) == ("", plan, "fp16")
    foreign = plan_with_manifest(tmp_path / "other.plan", "8.5.2", XAVIER)
    with pytest.raises(EdgedError, match=r"other.plan was built for another device.*put the ONNX model beside it"):
        prebuilt_entry(str(foreign), FakeTensorRT, lambda p: "")  # type: ignore[arg-type]


def test_a_version_with_only_a_model_onnx_is_built_here(tmp_path: Path) -> None:
    folder = model_folder(tmp_path, "det", PLAN_PBTXT)
    models, origins = read_repository(tmp_path, on_orin)
    assert models["det"].path == str(folder / "1" / "model.onnx")
    assert origins["det"].note == "no model.plan in the version folder: serving its model.onnx, built for this device"
