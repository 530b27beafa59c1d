"""The manifest of TensorRT's names per release (``scripts/data/tensorrt_api.json``) covers every
release edged runs on and agrees with the stubs of its own release; and every module of the
TensorRT backend postpones its annotations, which the walk of tensorrt_api_walk.py leaves out."""

from __future__ import annotations

import ast

from edged.backends.tensorrt.versions import parse_version
from tests.unit.tensorrt_api_walk import MODULE, PACKAGE, _stub_source, exists, manifest, release_versions


def test_every_module_of_the_package_postpones_its_annotations() -> None:
    for path in PACKAGE.glob("*.py"):
        tree = ast.parse(path.read_text())
        future = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "__future__"]
        if any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(tree)):
            assert any(a.name == "annotations" for n in future for a in n.names), path.name


def test_the_manifest_covers_every_release_edged_runs_on() -> None:
    versions = release_versions()
    assert sorted(versions, key=parse_version) == ["8.5", "8.6", "10.3", "10.13", "11.0", "11.1"]
    assert versions["8.5"] == (8, 5, 2)  # JetPack 5.1's TensorRT
    for info in manifest().values():
        assert len(str(info["commit"])) == 40 and info["classes"] and info["module"]


def test_the_manifest_agrees_with_the_stubs_of_its_release() -> None:
    """The extraction's own check: every name the 10.13 stubs declare (generated from the
    compiled module) is in the manifest read from 10.13's sources, but for a few dynamic ones."""
    tree = ast.parse(_stub_source())
    dynamic = {"Logger", "NodeIndices", "PluginFieldCollection", "SubGraphCollection"}  # setattr loops, vectors
    absent = []
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        if not exists("10.13", MODULE, node.name):
            absent.append(node.name)
            continue
        for item in node.body:
            name = item.name if isinstance(item, (ast.FunctionDef, ast.ClassDef)) else None
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                name = item.target.id
            if name and not name.startswith("__") and node.name not in dynamic and not exists("10.13", node.name, name):
                absent.append(f"{node.name}.{name}")
    assert absent == []
