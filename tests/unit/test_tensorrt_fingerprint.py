"""Fingerprint parsing and the TensorRT logger bridge, without TensorRT or a GPU."""

from __future__ import annotations

import logging
import sys
import threading
import types
from pathlib import Path

import pytest

from edged.backends.tensorrt.cuda import format_cuda_version
from edged.backends.tensorrt.fingerprint import (
    deb_cuda,
    parse_board,
    parse_driver_version,
    parse_tegra_release,
    wheel_cuda,
)
from edged.backends.tensorrt.trtlog import capture_errors, record, severity_level, wanted

JP5 = (
    "# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref, EABI: aarch64, "
    "DATE: Tue Aug  1 19:57:35 UTC 2023\n"
)
JP6 = (
    "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64, "
    "DATE: Wed Jan  8 01:49:37 UTC 2025\n# KERNEL_VARIANT: oot\n"
)
JP7 = "# R38 (release), REVISION: 2.0, GCID: 41844464, BOARD: generic, EABI: aarch64\n"


@pytest.mark.parametrize("text, want", [(JP5, "35.4.1"), (JP6, "36.4.3"), (JP7, "38.2.0"), ("", ""), ("garbage", "")])
def test_l4t_release(text: str, want: str) -> None:
    assert parse_tegra_release(text) == want


@pytest.mark.parametrize(
    "text, want",
    [
        (
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Thu Oct  9 2025\n"
            "GCC version:  gcc version 12.2.0\n",
            "580.159.04",
        ),
        (
            "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build  "
            "(dvs-builder@U16)  Thu Jan 23 2025\n",
            "570.86.15",
        ),
        (
            "NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  540.4.0  Release Build  "
            "(buildbrain@mobile)  Tue Jan  7 2025\n",
            "540.4.0",
        ),
        ("", ""),
    ],
)
def test_driver_version(text: str, want: str) -> None:
    assert parse_driver_version(text) == want


def test_cuda_version_from_the_driver_integer() -> None:
    assert format_cuda_version(12020) == "12.2"
    assert format_cuda_version(13000) == "13.0"
    assert format_cuda_version(11040) == "11.4"


def test_severities_map_to_logging_levels() -> None:
    assert severity_level(0) == logging.CRITICAL  # INTERNAL_ERROR
    assert severity_level(1) == logging.ERROR
    assert severity_level(2) == logging.WARNING
    assert severity_level(3) == logging.DEBUG  # INFO is memory chatter
    assert severity_level(4) == logging.DEBUG


def test_errors_logged_inside_a_capture_are_collected(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="edged.backends.tensorrt.trt"):
        record(2, "a warning")
        with capture_errors() as errors:
            record(2, "another warning")
            record(1, "engine plan is from another version")
            record(0, "internal")
        record(1, "after the capture")
    assert errors == ["engine plan is from another version", "internal"]
    assert [r.levelno for r in caplog.records] == [
        logging.WARNING,
        logging.WARNING,
        logging.ERROR,
        logging.CRITICAL,
        logging.ERROR,
    ]


def test_captures_are_per_thread() -> None:
    seen: list[str] = []

    def other() -> None:
        record(1, "from another thread")

    with capture_errors() as errors:
        t = threading.Thread(target=other)
        t.start()
        t.join()
        record(1, "mine")
        seen = list(errors)
    assert seen == ["mine"]


def test_tensorrt_cuda_build_from_wheel_names() -> None:
    assert wheel_cuda(["tensorrt", "tensorrt-cu12", "tensorrt_cu12_bindings", "tensorrt_cu12_libs"]) == "cu12"
    assert wheel_cuda(["tensorrt-cu13", "tensorrt_cu13_libs"]) == "cu13"
    assert wheel_cuda(["tensorrt", "tensorrt-stubs"]) == ""


def test_tensorrt_cuda_build_from_jetpack_packages() -> None:
    status = (
        "Package: libnvinfer-dev\nVersion: 10.3.0.30-1+cuda12.5\n\n"
        "Package: libnvinfer10\nStatus: install ok installed\nVersion: 10.3.0.30-1+cuda12.5\n\n"
    )
    assert deb_cuda(status) == "cuda12.5"
    assert deb_cuda("Package: libnvinfer8\nVersion: 8.5.2-1+cuda11.4\n") == "cuda11.4"
    assert deb_cuda("Package: python3\nVersion: 3.10\n") == ""


def test_board_names_the_module_sku() -> None:
    nano = parse_board(
        "NVIDIA Jetson Orin Nano Engineering Reference Developer Kit\x00",
        "nvidia,p3768-0000+p3767-0003\x00nvidia,p3767-0003\x00nvidia,tegra234\x00",
    )
    nx = parse_board(
        "NVIDIA Jetson Orin Nano Engineering Reference Developer Kit\x00",
        "nvidia,p3768-0000+p3767-0001\x00nvidia,p3767-0001\x00",
    )
    assert nano != nx and "p3767-0003" in nano and "p3767-0001" in nx
    assert parse_board("", "") == ""


def test_verbose_messages_are_dropped_first_unless_debug_is_on(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="edged.backends.tensorrt.trt"):
        assert wanted(1) and wanted(2) and not wanted(4) and not wanted(3)
    with caplog.at_level(logging.DEBUG, logger="edged.backends.tensorrt.trt"):
        assert wanted(4)


class FakeDevice:
    """Stands in for ``cuda.CudaDevice`` (what the fingerprint reads of it) in this unit test."""

    def __init__(self, ordinal: int) -> None:
        self.name = ["NVIDIA H200", "NVIDIA RTX A2000"][ordinal]
        self.compute_capability = ["9.0", "8.6"][ordinal]
        self.sm_count = [132, 26][ordinal]


def test_the_key_names_the_gpu_the_engine_is_built_on_and_not_pycudas_cuda(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On a host with two different GPUs, an engine built for ``tensorrt.device = 1`` is keyed by
    GPU 1; pycuda's own CUDA build (it allocates and copies, the engine never sees it) is in no key."""
    from edged.backends.tensorrt import TensorRTBackend
    from edged.backends.tensorrt import backend as backend_mod
    from edged.backends.tensorrt import fingerprint as fingerprint_mod
    from edged.quantize.job import BuildJob, key_fields

    module = types.ModuleType("tensorrt")
    module.__version__ = "10.13.3.9"  # type: ignore[attr-defined]  # a fake: the version is all it has
    monkeypatch.setitem(sys.modules, "tensorrt", module)
    monkeypatch.setattr(backend_mod, "shared_device", FakeDevice)
    monkeypatch.setattr(fingerprint_mod, "cuda_versions", lambda: ("13.0", "12.9"))
    backend_mod._fingerprint.cache_clear()
    try:
        second = TensorRTBackend.device_fingerprint({"device": 1})
        first = TensorRTBackend.device_fingerprint({})
        job = BuildJob("m", "m.onnx", "fp32", "tensorrt", str(tmp_path), "digest", options={"device": 1})
        keyed = key_fields(job, TensorRTBackend)["device"]
    finally:
        backend_mod._fingerprint.cache_clear()
    assert (second["gpu"], second["compute_capability"], second["sm_count"]) == ("NVIDIA RTX A2000", "8.6", "26")
    assert first["gpu"] == "NVIDIA H200" and keyed == second
    assert "cuda_build" not in second and second["cuda_driver"] == "13.0"
