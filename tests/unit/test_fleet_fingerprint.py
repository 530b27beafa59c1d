"""The device fingerprint's JetPack version, read from dpkg's status file."""

from __future__ import annotations

from pathlib import Path

from edged.fleet.fingerprint import _jetpack, device_fingerprint


def test_jetpack_is_the_nvidia_jetpack_package_version(tmp_path: Path) -> None:
    status = tmp_path / "status"
    status.write_text(
        "Package: nvidia-l4t-core\nVersion: 36.4.3-20250107\n\n"
        "Package: nvidia-jetpack\nStatus: install ok installed\nVersion: 6.2+b77\n\n"
    )
    assert _jetpack(str(status)) == "6.2+b77"
    status.write_text("Package: other\nVersion: 1\n")
    assert _jetpack(str(status)) == ""
    assert _jetpack(str(tmp_path / "missing")) == ""
    assert set(device_fingerprint()) == {"board", "l4t", "jetpack", "tensorrt", "onnxruntime", "machine"}
