"""Fingerprint parsing and the TensorRT logger bridge, without TensorRT or a GPU."""

from __future__ import annotations

import logging
import threading

import pytest

from edged.backends.tensorrt.cuda import format_cuda_version
from edged.backends.tensorrt.fingerprint import parse_driver_version, parse_tegra_release
from edged.backends.tensorrt.trtlog import capture_errors, record, severity_level

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
