"""What a device is, for the fleet's state reports: the board, JetPack (its L4T release) and
TensorRT, read from files and package metadata without importing TensorRT (only its backend
may), so that an operator sees which kind of device failed a gate."""

from __future__ import annotations

import importlib.metadata
import platform
import re

TEGRA_RELEASE = "/etc/nv_tegra_release"
BOARD_MODEL = "/proc/device-tree/model"
DPKG_STATUS = "/var/lib/dpkg/status"
_TEGRA_RE = re.compile(r"R(\d+)\s*\(release\),\s*REVISION:\s*(\d+(?:\.\d+)*)")


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(4096).strip("\x00").strip()
    except OSError:
        return ""


def _installed(*names: str) -> str:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return ""


def _jetpack(dpkg_status: str = DPKG_STATUS) -> str:
    """The ``nvidia-jetpack`` package's version (``6.1+b123``), "" when it is not installed; the
    status file is read line by line (it is megabytes on a full install)."""
    try:
        with open(dpkg_status, encoding="utf-8", errors="replace") as f:
            package = ""
            for line in f:
                if line.startswith("Package: "):
                    package = line[9:].strip()
                elif package == "nvidia-jetpack" and line.startswith("Version: "):
                    return line[9:].strip()
    except OSError:
        pass
    return ""


def device_fingerprint() -> dict[str, str]:
    """``board`` ("" off a device-tree board), ``l4t`` ("36.4.3"; "" off a Jetson), ``jetpack``
    (its package's version), ``tensorrt``
    ("" when not installed), the machine and the ONNX Runtime that runs the stand-ins."""
    m = _TEGRA_RE.search(_read(TEGRA_RELEASE))
    return {
        "board": _read(BOARD_MODEL),
        "l4t": f"{m.group(1)}.{m.group(2)}" if m else "",
        "jetpack": _jetpack(),
        "tensorrt": _installed("tensorrt", "tensorrt-cu12", "tensorrt-cu13"),
        "onnxruntime": _installed("onnxruntime", "onnxruntime-gpu"),
        "machine": platform.machine(),
    }
