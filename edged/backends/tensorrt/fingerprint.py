"""What a TensorRT engine is bound to, for the cache key (design section 5).

An engine only loads on the TensorRT version that built it and is tuned for one GPU; the driver,
CUDA and L4T release can change kernels' behaviour underneath it. All of them go into the key, so
an upgrade rebuilds instead of loading a stale or incompatible engine.
"""

from __future__ import annotations

import re

from edged.backends.tensorrt.cuda import CudaDevice, cuda_versions

TEGRA_RELEASE = "/etc/nv_tegra_release"
DRIVER_VERSION = "/proc/driver/nvidia/version"

_TEGRA_RE = re.compile(r"R(\d+)\s*\(release\),\s*REVISION:\s*(\d+(?:\.\d+)*)")
_DRIVER_RE = re.compile(r"Kernel Module\b.*?\s(\d+\.\d+(?:\.\d+)*)\s")


def parse_tegra_release(text: str) -> str:
    """``# R36 (release), REVISION: 4.3, GCID: ...`` → ``36.4.3``; "" when not a Jetson."""
    m = _TEGRA_RE.search(text)
    return f"{m.group(1)}.{m.group(2)}" if m else ""


def parse_driver_version(text: str) -> str:
    """The kernel module's version from ``/proc/driver/nvidia/version``; "" when absent."""
    m = _DRIVER_RE.search(text)
    return m.group(1) if m else ""


def read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(4096)
    except OSError:
        return ""


def gpu_fingerprint(device: CudaDevice) -> dict[str, str]:
    """Everything but the TensorRT version (which the caller adds): the GPU side alone."""
    cuda_driver, cuda_build = cuda_versions()
    return {
        "gpu": device.name,
        "compute_capability": device.compute_capability,
        "sm_count": str(device.sm_count),
        "driver": parse_driver_version(read_text(DRIVER_VERSION)),
        "cuda_driver": cuda_driver,
        "cuda_build": cuda_build,
        "l4t": parse_tegra_release(read_text(TEGRA_RELEASE)),
    }
