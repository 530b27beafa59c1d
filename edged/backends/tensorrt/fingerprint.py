"""What a TensorRT engine is bound to, for the cache key (design section 5).

An engine only loads on the TensorRT version that built it and is tuned for one GPU; the driver,
CUDA and L4T release can change kernels' behaviour underneath it. All of them go into the key, so
an upgrade rebuilds instead of loading a stale or incompatible engine.
"""

from __future__ import annotations

import importlib.metadata
import re

from edged.backends.tensorrt.cuda import CudaDevice, cuda_versions

TEGRA_RELEASE = "/etc/nv_tegra_release"
DRIVER_VERSION = "/proc/driver/nvidia/version"
BOARD_MODEL = "/proc/device-tree/model"
BOARD_COMPATIBLE = "/proc/device-tree/compatible"
DPKG_STATUS = "/var/lib/dpkg/status"

_WHEEL_CUDA_RE = re.compile(r"^tensorrt[-_](?:cu(\d+))(?:[-_]|$)", re.IGNORECASE)
_DEB_CUDA_RE = re.compile(r"\+cuda(\d+(?:\.\d+)*)")

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
    """Everything but the TensorRT version (which the caller adds): the GPU side alone. Not the
    CUDA that pycuda was compiled against: pycuda only allocates and copies, the engine never
    sees it, and a pycuda rebuilt for another CUDA must not rebuild every engine."""
    cuda_driver, _ = cuda_versions()
    return {
        "gpu": device.name,
        "compute_capability": device.compute_capability,
        "sm_count": str(device.sm_count),
        "driver": parse_driver_version(read_text(DRIVER_VERSION)),
        "cuda_driver": cuda_driver,
        "l4t": parse_tegra_release(read_text(TEGRA_RELEASE)),
    }


def wheel_cuda(dist_names: list[str]) -> str:
    """``cu12``/``cu13`` from the names of the installed TensorRT wheels (``tensorrt-cu12``,
    ``tensorrt_cu13_libs``...); "" when none names its CUDA."""
    found = sorted({m.group(1) for n in dist_names if (m := _WHEEL_CUDA_RE.match(n))})
    return ",".join(f"cu{v}" for v in found)


def deb_cuda(dpkg_status: str) -> str:
    """The CUDA a Debian-packaged libnvinfer was built for (JetPack: ``10.3.0.30-1+cuda12.5``)."""
    package = ""
    for line in dpkg_status.splitlines():
        if line.startswith("Package: "):
            package = line.split(": ", 1)[1].strip()
        elif line.startswith("Version: ") and re.fullmatch(r"libnvinfer\d+", package):
            m = _DEB_CUDA_RE.search(line)
            if m:
                return f"cuda{m.group(1)}"
    return ""


def tensorrt_cuda() -> str:
    """The CUDA build of the installed TensorRT (cu12 and cu13 wheels share one version string)."""
    names = [str(d.metadata["Name"] or "") for d in importlib.metadata.distributions()]
    found = wheel_cuda([n for n in names if n.lower().startswith("tensorrt")])
    if found:
        return found
    try:
        with open(DPKG_STATUS, encoding="utf-8", errors="replace") as f:
            return deb_cuda(f.read())
    except OSError:
        return ""


def parse_board(model: str, compatible: str) -> str:
    """The device tree's model, and its first ``compatible`` entry, which names the module and
    its SKU (``nvidia,p3767-0003`` is an Orin Nano 8GB, ``-0001`` an Orin NX 8GB) where the model
    string may name only the carrier board."""
    name = model.strip("\x00").strip()
    sku = next((c for c in compatible.split("\x00") if c.strip()), "").strip()
    return f"{name} ({sku})" if name and sku else name or sku


def board_model() -> str:
    """ "" off a device-tree board (a PC with a discrete GPU)."""
    return parse_board(read_text(BOARD_MODEL), read_text(BOARD_COMPATIBLE))
