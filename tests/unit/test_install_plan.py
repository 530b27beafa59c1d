"""scripts/install.sh on each JetPack, from fixtures of the files it reads: /etc/nv_tegra_release,
dpkg's status file and python3-libnvinfer's file list, the TensorRT header. ``--plan`` prints
what it would do about TensorRT and pycuda and changes nothing; ``EDGED_INSTALL_ROOT`` points it
at the fixture instead of ``/``. The Python is a stand-in that answers its version (the one
question the plan asks of it). The install itself is tested in a booted systemd
(tests/system/test_install.py); building the bindings needs a Jetson (docs/tensorrt.md)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "install.sh"


@dataclass(frozen=True)
class JetPack:
    release: str  # /etc/nv_tegra_release's first line
    packages: dict[str, str]  # installed Debian packages and their versions
    bindings: str = ""  # the Python python3-libnvinfer installed its files for
    header: tuple[int, int, int, int] | None = None  # NvInferVersion.h (libnvinfer-dev)
    enterprise_header: bool = False  # 10.13's header names its numbers TRT_*_ENTERPRISE
    extra: dict[str, str] = field(default_factory=dict)


def tegra(release: str, revision: str, gcid: str, board: str, date: str) -> str:
    """/etc/nv_tegra_release's first line, as L4T writes it."""
    return f"# {release} (release), REVISION: {revision}, GCID: {gcid}, BOARD: {board}, EABI: aarch64, DATE: {date}"


JETPACKS = {
    "4.6": JetPack(
        tegra("R32", "7.4", "33514132", "t210ref", "Fri Jun  9 04:25:08 UTC 2023"),
        {"libnvinfer8": "8.2.1-1+cuda10.2", "python3-libnvinfer": "8.2.1-1+cuda10.2"},
        "3.6",
    ),
    "5.0.2": JetPack(
        tegra("R35", "1.0", "31250864", "t186ref", "Thu Aug 11 03:40:29 UTC 2022"),
        {"libnvinfer8": "8.4.1-1+cuda11.4", "python3-libnvinfer": "8.4.1-1+cuda11.4"},
        "3.8",
    ),
    "5.1.2": JetPack(
        tegra("R35", "4.1", "33958178", "t186ref", "Tue Aug  1 19:57:35 UTC 2023"),
        {"libnvinfer8": "8.5.2-1+cuda11.4", "python3-libnvinfer": "8.5.2-1+cuda11.4", "tensorrt": "8.5.2.2-1+cuda11.4"},
        "3.8",
        header=(8, 5, 2, 2),
    ),
    "6.0": JetPack(
        tegra("R36", "3.0", "36191598", "generic", "Mon May  6 17:34:21 UTC 2024"),
        {"libnvinfer8": "8.6.2.3-1+cuda12.2", "python3-libnvinfer": "8.6.2.3-1+cuda12.2"},
        "3.10",
        header=(8, 6, 2, 3),
    ),
    "6.2": JetPack(
        tegra("R36", "4.3", "38968081", "generic", "Wed Jan  8 01:49:37 UTC 2025"),
        {"libnvinfer10": "10.3.0.30-1+cuda12.5", "python3-libnvinfer": "10.3.0.30-1+cuda12.5"},
        "3.10",
    ),
    "7.0": JetPack(
        tegra("R38", "2.0", "41844464", "generic", "Mon Aug 11 03:31:20 UTC 2025"),
        {"libnvinfer10": "10.13.3.9-1+cuda13.0", "python3-libnvinfer": "10.13.3.9-1+cuda13.0"},
        "3.12",
        header=(10, 13, 3, 9),
        enterprise_header=True,
    ),
}


def status_file(packages: dict[str, str]) -> str:
    """dpkg's status file: one stanza per package, as dpkg writes them (other packages around)."""
    stanzas = [
        "Package: python3\nStatus: install ok installed\nPriority: important\nVersion: 3.8.2-0ubuntu2\n",
        "Package: libnvinfer-bin\nStatus: deinstall ok config-files\nVersion: 8.4.1-1+cuda11.4\n",
    ]
    for name, version in packages.items():
        stanzas.append(
            f"Package: {name}\nStatus: install ok installed\nPriority: optional\nSection: libs\n"
            f"Installed-Size: 512\nMaintainer: cudatools <cudatools@nvidia.com>\nArchitecture: arm64\n"
            f"Source: tensorrt\nVersion: {version}\nDescription: TensorRT\n"
        )
    return "\n".join(stanzas)


def header(numbers: tuple[int, int, int, int], enterprise: bool) -> str:
    keys = ("MAJOR", "MINOR", "PATCH", "BUILD")
    if enterprise:
        lines = [f"#define TRT_{k}_ENTERPRISE {n}" for k, n in zip(keys, numbers)]
        lines += [f"#define NV_TENSORRT_{k} TRT_{k}_ENTERPRISE //!< TensorRT {k.lower()}." for k in keys]
    else:
        lines = [f"#define NV_TENSORRT_{k} {n} //!< TensorRT {k.lower()} version." for k, n in zip(keys, numbers)]
    return "#ifndef NV_INFER_VERSION_H\n#define NV_INFER_VERSION_H\n" + "\n".join(lines) + "\n#endif\n"


def make_root(tmp_path: Path, jp: JetPack | None) -> Path:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "var/lib/dpkg/info").mkdir(parents=True)
    if jp is None:
        (root / "var/lib/dpkg/status").write_text(status_file({}))
        return root
    (root / "etc/nv_tegra_release").write_text(jp.release + "\n")
    (root / "var/lib/dpkg/status").write_text(status_file(jp.packages))
    if jp.bindings:
        files = ["/.", "/usr", f"/usr/lib/python{jp.bindings}/dist-packages/tensorrt"]
        files += [f"/usr/lib/python{jp.bindings}/dist-packages/tensorrt/{f}" for f in ("__init__.py", "tensorrt.so")]
        (root / "var/lib/dpkg/info/python3-libnvinfer.list").write_text("\n".join(files) + "\n")
    if jp.header:
        include = root / "usr/include/aarch64-linux-gnu"
        include.mkdir(parents=True)
        (include / "NvInferVersion.h").write_text(header(jp.header, jp.enterprise_header))
    return root


def fake_python(tmp_path: Path, version: str) -> Path:
    """A stand-in interpreter for this unit test: it answers any question with its version."""
    path = tmp_path / f"python{version}"
    path.write_text(f"#!/bin/sh\necho {version}\n")
    path.chmod(0o755)
    return path


def run_bash(root: Path, *args: str) -> str:
    """bash with these arguments, reading the JetPack files under ``root``: its output."""
    env = {"PATH": "/usr/bin:/bin", "EDGED_INSTALL_ROOT": str(root), "EDGED_ARCH": "aarch64"}
    return subprocess.run(["bash", *args], env=env, capture_output=True, text=True, check=True).stdout


def plan_of(root: Path, python: Path, *args: str) -> dict[str, str]:
    out = run_bash(root, str(SCRIPT), "--plan", "--python", str(python), *args)
    return dict(line.split("=", 1) for line in out.splitlines())


def plan(tmp_path: Path, jetpack: str | None, python: str, *args: str) -> dict[str, str]:
    root = make_root(tmp_path, JETPACKS[jetpack] if jetpack else None)
    return plan_of(root, fake_python(tmp_path, python), *args)


def sourced(root: Path, script: str) -> str:
    """Run ``script`` after sourcing install.sh (which then defines its functions only)."""
    return run_bash(root, "-c", f'source "{SCRIPT}"; {script}').strip()


JP5_COMMIT = "NVIDIA/TensorRT@ad932f72126f875392a4336d9ee45b2756d934a0"


@pytest.mark.parametrize(
    "jetpack, python, expected",
    [
        # JetPack 5.1: its bindings are for Python 3.8: built for 3.10 from the 8.5.2.2 sources
        ("5.1.2", "3.10", {"l4t": "35.4.1", "jetpack": "5", "tensorrt": "8.5.2.2", "bindings_python": "3.8",
                           "plan": "build", "source": JP5_COMMIT, "pybind11": "v2.13.6"}),
        ("5.1.2", "3.12", {"plan": "build", "source": JP5_COMMIT}),
        # JetPack 6 and 7: their own bindings, for the Python they ship
        ("6.0", "3.10", {"l4t": "36.3.0", "jetpack": "6", "tensorrt": "8.6.2.3", "bindings_python": "3.10",
                         "plan": "system"}),
        ("6.2", "3.10", {"l4t": "36.4.3", "jetpack": "6", "tensorrt": "10.3.0.30", "plan": "system"}),
        ("7.0", "3.12", {"l4t": "38.2.0", "jetpack": "7", "tensorrt": "10.13.3.9", "bindings_python": "3.12",
                         "plan": "system"}),
    ],
)  # fmt: skip
def test_tensorrt_is_made_to_import_on_each_jetpack(
    tmp_path: Path, jetpack: str, python: str, expected: dict[str, str]
) -> None:
    got = plan(tmp_path, jetpack, python)
    assert {k: got.get(k) for k in expected} == expected
    assert got["pycuda"] == "pip, built against /usr/local/cuda" and "why" not in got


@pytest.mark.parametrize(
    "jetpack, python, why",
    [
        ("4.6", "3.10", "L4T 32.7.4 (JetPack 4) ships TensorRT 8.2 or older and Python 3.6; edged's TensorRT "
                        "backend needs TensorRT 8.5 (JetPack 5.1) or newer"),
        ("5.0.2", "3.10", "JetPack 5 here has TensorRT 8.4.1; edged needs 8.5 or newer (JetPack 5.1+): upgrade "
                          "JetPack (L4T 35.2 or later)"),
        ("7.0", "3.10", "JetPack 7's TensorRT 10.13.3.9 has Python bindings for Python 3.12, and"),
    ],
)  # fmt: skip
def test_a_jetpack_tensorrt_cannot_work_on_is_refused_with_the_reason(
    tmp_path: Path, jetpack: str, python: str, why: str
) -> None:
    got = plan(tmp_path, jetpack, python)
    assert got["plan"] == "refuse" and got["pycuda"] == "none"
    assert got["why"].startswith(why) and got["why"].endswith("or install with --cpu-only")


def test_jetpack_6_without_python3_libnvinfer_installs_it(tmp_path: Path) -> None:
    root = make_root(tmp_path, JETPACKS["6.2"])
    status = root / "var/lib/dpkg/status"
    status.write_text(status_file({"libnvinfer10": "10.3.0.30-1+cuda12.5"}))
    (root / "var/lib/dpkg/info/python3-libnvinfer.list").unlink()
    got = plan_of(root, fake_python(tmp_path, "3.10"))
    assert (got["tensorrt"], got["bindings_python"], got["plan"]) == ("10.3.0.30", "3.10", "apt")


def test_without_tensorrt_a_jetson_is_refused_and_cpu_only_installs_for_the_cpu(tmp_path: Path) -> None:
    got = plan_of(make_root(tmp_path, JetPack(JETPACKS["6.2"].release, {})), fake_python(tmp_path, "3.10"))
    assert got["plan"] == "refuse" and got["why"].startswith("TensorRT is not installed (no libnvinfer)")
    got = plan(tmp_path / "cpu", "5.1.2", "3.10", "--cpu-only")
    assert got["plan"] == "cpu" and got["why"].startswith("--cpu-only: ONNX Runtime serves on the CPU")


def test_off_a_jetson_tensorrt_is_the_operators(tmp_path: Path) -> None:
    got = plan(tmp_path, None, "3.11")
    assert (got["l4t"], got["jetpack"], got["plan"], got["pycuda"]) == ("none", "none", "none", "none")
    assert got["why"].startswith("not a Jetson: for an NVIDIA GPU install TensorRT's wheel")


def test_the_version_comes_from_the_header_else_from_the_packages(tmp_path: Path) -> None:
    jp5 = make_root(tmp_path / "a", JETPACKS["5.1.2"])
    assert sourced(jp5, "tensorrt_version") == "8.5.2.2"
    (jp5 / "usr/include/aarch64-linux-gnu/NvInferVersion.h").unlink()
    assert sourced(jp5, "tensorrt_version") == "8.5.2.2"  # the tensorrt package has the build
    assert sourced(jp5, "deb_version libnvinfer8; deb_version libnvinfer-bin; echo end") == "8.5.2-1+cuda11.4\nend"
    jp7 = make_root(tmp_path / "b", JETPACKS["7.0"])
    assert sourced(jp7, "tensorrt_version") == "10.13.3.9"


def test_jetpack_5s_python_is_told_how_to_get_a_newer_one(tmp_path: Path) -> None:
    hint = sourced(make_root(tmp_path / "a", JETPACKS["5.1.2"]), "python_hint")
    assert hint.startswith("JetPack 5's Python is 3.8: install Python 3.10 (sudo add-apt-repository ppa:deadsnakes")
    assert hint.endswith("builds TensorRT's Python bindings for it")
    assert sourced(make_root(tmp_path / "b", JETPACKS["6.2"]), "python_hint").startswith("pass --python PATH")


def test_bindings_built_before_are_reused_not_built_again(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    kept = wheels / "tensorrt-8.5.2.2-cp310-none-linux_aarch64.whl"
    kept.write_bytes(b"wheel")
    python = fake_python(tmp_path, "3.10")
    script = f'PYTHON="{python}"; WHEEL_DIR="{wheels}"; TRT_VERSION=8.5.2.2; build_tensorrt_bindings'
    assert sourced(make_root(tmp_path, JETPACKS["5.1.2"]), script) == str(kept)
