"""The installed package's metadata says what pyproject.toml promises."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]


def requirements() -> dict[str, Requirement]:
    reqs = [Requirement(r) for r in importlib.metadata.metadata("edged").get_all("Requires-Dist") or []]
    return {r.name.lower(): r for r in reqs if r.marker is None or "extra" not in str(r.marker)}


def test_license_is_an_spdx_expression_with_its_file() -> None:
    meta = importlib.metadata.metadata("edged")
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    assert "Apache License" in (REPO / "LICENSE").read_text()[:200]
    build = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
    assert any(Requirement(r).name == "setuptools" and Requirement(r).specifier.contains("77") for r in build)
    assert not any(Requirement(r).specifier.contains("76.9") for r in build if r.startswith("setuptools"))


def test_runtime_dependencies_image_calibration_and_a_bounded_uvicorn() -> None:
    runtime = requirements()
    assert "pillow" in runtime  # image calibration decodes with Pillow
    uvicorn = runtime["uvicorn"].specifier
    installed = importlib.metadata.version("uvicorn")
    assert uvicorn.contains(installed), f"the tested uvicorn {installed} is outside {uvicorn}"
    major, minor = (int(p) for p in installed.split(".")[:2])
    following = f"{major}.{minor + 1}.0" if major == 0 else f"{major + 1}.0.0"
    assert not uvicorn.contains(following), f"uvicorn {following} is untested but allowed by {uvicorn}"


def test_lint_and_type_tools_are_pinned_in_the_constraints_file() -> None:
    pins = {}
    for line in (REPO / "scripts" / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            pins[req.name] = str(req.specifier)
    assert pins["ruff"].startswith("==") and pins["mypy"].startswith("==")
    assert importlib.metadata.version("ruff") == pins["ruff"][2:]
    assert importlib.metadata.version("mypy") == pins["mypy"][2:]
    assert "-c scripts/constraints.txt" in (REPO / "scripts" / "test.sh").read_text()


def _llama_key(**env: str) -> str:
    script = REPO / "scripts" / "llama_install.sh"
    out = subprocess.run(
        ["bash", str(script), "--key", sys.executable],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def test_the_llama_build_is_keyed_by_its_cmake_options() -> None:
    # pip's wheel cache keys a source build by the sdist alone: a wheel built with other options
    # would be installed again. The project's own cache must tell the builds apart.
    default = _llama_key()
    assert len(default) == 16
    assert _llama_key(CMAKE_ARGS="-DGGML_CUDA=on") != default
    assert _llama_key() == default
