"""Import structure: the architecture's contracts hold, no cycles between edged's modules, and a
client that stays light.

The layers and forbidden imports are import-linter's contracts (``[tool.importlinter]`` in
pyproject.toml). CI runs ``lint-imports``; the tests below run it too, on the tree and on copies
with an import that breaks one contract each. Cycles are checked here, on a graph read from the
source with ``ast``: every ``import`` and ``from ... import`` of an edged module, at module level or
inside a function (a lazy import still ties two modules together).
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import edged

PACKAGE = Path(edged.__file__).resolve().parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                graph[mod] |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([node.module] if node.module else [])])
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    if target in files:
                        graph[mod].add(target)  # `from edged import errors` names a module
                    elif base in files:
                        graph[mod].add(base)
    for mod in graph:
        graph[mod].discard(mod)
        # A module's own package __init__ is imported with it; an edge to it is no cycle.
        graph[mod] = {t for t in graph[mod] if not mod.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_graph_is_read_from_the_source() -> None:
    graph = import_graph()
    assert {"edged.cli", "edged.lifecycle.daemon", "edged.client", "edged.backends.base"} <= set(graph)
    assert "edged.errors" in graph["edged.client.clients"]
    assert "edged.tools.table" in graph["edged.tools.plan"]  # a function-level import counts as well
    assert graph["edged.errors"] == set()  # the leaf the design names


def test_cycles_are_found() -> None:
    """The detector itself, on a graph with a two-module and a three-module cycle."""
    graph = {"a": {"b"}, "b": {"a", "c"}, "c": set(), "x": {"y"}, "y": {"z"}, "z": {"x"}}
    assert sorted(cycles(graph)) == [["a", "b"], ["x", "y", "z"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycles_in_edged() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_client_imports_nothing_heavy() -> None:
    """A camera script that imports edged.client must not pay for the daemon's libraries."""
    heavy = ["msgspec", "onnx", "onnxruntime", "uvicorn", "paho", "prometheus_client", "edged.config"]
    code = f"import sys, edged.client; print(','.join(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "", f"importing edged.client loads {out.stdout.strip()}"


REPO = PACKAGE.parent


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("lint-imports")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "importlinter.cli"]
    return subprocess.run([*cmd, "--no-cache"], cwd=root, capture_output=True, text=True, timeout=120, env=_env(root))


def _env(root: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(root)}


def test_the_architecture_contracts_hold() -> None:
    run = lint_imports(REPO)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("edged/wire/tensors.py", "from edged.serving import states", "edged is layered"),
        ("edged/transports/http/app.py", "from edged.backends import base", "Transports never import a backend"),
        ("edged/client/shm.py", "from edged.config import Config", "The client imports nothing of the daemon"),
        ("edged/serving/service.py", "import pycuda.driver", "Only the TensorRT backend"),
        ("edged/transports/mqtt/codec.py", "from edged.transports.http import body", "HTTP and MQTT are independent"),
    ],
)
def test_a_broken_contract_fails_the_check(tmp_path: Path, module: str, line: str, contract: str) -> None:
    """Negative controls: each contract catches an import that breaks it."""
    shutil.copytree(PACKAGE, tmp_path / "edged", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n{line}  # noqa\n")
    run = lint_imports(tmp_path)
    assert run.returncode != 0
    broken = run.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken, run.stdout
