#!/usr/bin/env python3
"""Write the TensorRT Python API of each release edged runs on, as data the unit tests read.

TensorRT itself cannot be installed on the test machines, and the type stubs describe one
release only, so the names each release's ``tensorrt`` module offers are read from the source of
its bindings: the pybind11 files of NVIDIA's open-source TensorRT repository
(``python/src/**/*.cpp``) and the package's ``__init__.py``, at the commit of each release.

    python scripts/trt_api_manifest.py GIT_DIR [--out scripts/data/tensorrt_api.json]

GIT_DIR is a clone (bare or not) of https://github.com/NVIDIA/TensorRT. What is read:

- ``py::class_<...>(m, "Name", ...)`` and ``py::enum_<...>(parent, "Name", ...)``, also bound to a
  variable (``py::class_<...> binding{m, "Name"}``, later ``binding.def(...)``); a class or enum
  whose parent is another binding is named ``Parent.Name`` (``ILogger.Severity``);
- the members chained on them: ``.def``, ``.def_static``, ``.def_property``,
  ``.def_property_readonly``, ``.def_readwrite``, ``.def_readonly``, ``.value`` (the name is the
  first argument, a string literal; ``.def(py::init...)`` is ``__init__``);
- ``m.def("name", ...)`` and ``m.attr("name")``: module functions and attributes;
- the package's ``__init__.py``: its top-level functions, classes and assignments, and
  ``Class.attr = ...`` additions.

Every enum also has pybind11's ``name`` and ``value``. The output lists, per release, the commit,
the version its headers declare, the module's names and each class's members, sorted.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

# Release -> the commit of NVIDIA/TensorRT whose bindings it ships. 8.5.2.2 is JetPack 5.1's
# TensorRT (the "8.5.2.2 release updates" commit on release/8.5, which has no tag); 8.6.1 is the
# newest 8.6 source NVIDIA published (JetPack 6.0 ships 8.6.2, whose bindings match it).
RELEASES: dict[str, str] = {
    "8.5": "ad932f72126f875392a4336d9ee45b2756d934a0",
    "8.6": "v8.6.1",
    "10.3": "v10.3.0",
    "10.13": "v10.13.3",
    "11.0": "v11.0",
    "11.1": "v11.1",
}
MEMBER_CALLS = frozenset(
    {
        "def",
        "def_static",
        "def_property",
        "def_property_readonly",
        "def_property_static",
        "def_property_readonly_static",
        "def_readwrite",
        "def_readonly",
        "def_readwrite_static",
        "def_readonly_static",
        "attr",
        "value",
    }
)
ENUM_IMPLICIT = ("name", "value")
DEFAULT_OUT = Path(__file__).resolve().parent / "data" / "tensorrt_api.json"


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


def string_end(src: str, i: int) -> int:
    """The index just past the string or character literal that opens at ``src[i]``."""
    j = i + 1
    while j < len(src) and src[j] != src[i]:
        j += 2 if src[j] == "\\" else 1
    return j + 1


def strip_comments(src: str) -> str:
    """C++ without comments; string and character literals kept as they are."""
    out: list[str] = []
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if c in "\"'":
            j = string_end(src, i)
            out.append(src[i:j])
            i = j
        elif src.startswith("//", i):
            j = src.find("\n", i)
            i = n if j < 0 else j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            i = n if j < 0 else j + 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def balanced(src: str, i: int) -> int:
    """The index just past the bracket that closes the one at ``src[i]`` (strings skipped)."""
    pairs = {"(": ")", "{": "}", "[": "]", "<": ">"}
    stack = [pairs[src[i]]]
    j = i + 1
    while j < len(src) and stack:
        c = src[j]
        if c in "\"'":
            j = string_end(src, j)
            continue
        if stack[-1] == ">":  # template arguments: only angle brackets and parentheses nest
            if c == "<":
                stack.append(">")
            elif c == "(":
                stack.append(")")
            elif c == stack[-1]:
                stack.pop()
        elif c in "({[":
            stack.append(pairs[c])
        elif c == stack[-1]:
            stack.pop()
        j += 1
    return j


def split_args(text: str) -> list[str]:
    """Top-level comma-separated arguments of a call's inside."""
    args, depth, start, i = [], 0, 0, 0
    while i < len(text):
        c = text[i]
        if c in "\"'":
            i = string_end(text, i)
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            args.append(text[start:i].strip())
            start = i + 1
        i += 1
    tail = text[start:].strip()
    if tail:
        args.append(tail)
    return args


_STRING = re.compile(r'^"((?:[^"\\]|\\.)*)"$')


def literal(arg: str) -> str | None:
    m = _STRING.match(arg.strip())
    return m.group(1) if m else None


@dataclass
class Api:
    module: set[str] = field(default_factory=set)
    classes: dict[str, set[str]] = field(default_factory=dict)
    enums: set[str] = field(default_factory=set)

    def member(self, cls: str, name: str) -> None:
        self.classes.setdefault(cls, set()).add(name)


_BINDING = re.compile(r"py::(class_|enum_|bind_vector|bind_map)\s*<")
_SPACE = re.compile(r"\s*")


def _chain(src: str, i: int, api: Api, cls: str, scope: str | None = None) -> int:
    """Read ``.def("x", ...).value("Y", ...)...`` from ``src[i]``; return where it ends. An
    enum's ``.export_values()`` puts its values into ``scope`` too (the module, "" , or a class)."""
    values: list[str] = []
    while True:
        j = _SPACE.match(src, i).end()  # type: ignore[union-attr]
        if j >= len(src) or src[j] != ".":
            return i
        m = re.compile(r"\.\s*(\w+)\s*\(").match(src, j)
        if not m:
            return i
        end = balanced(src, m.end() - 1)
        args = split_args(src[m.end() : end - 1])
        call = m.group(1)
        if call in MEMBER_CALLS and args:
            name = literal(args[0])
            if name is not None:
                api.member(cls, name)
                if call == "value":
                    values.append(name)
            elif call == "def" and args[0].startswith("py::init"):
                api.member(cls, "__init__")
        elif call == "export_values" and scope is not None:
            for value in values:
                api.module.add(value) if scope == "" else api.member(scope, value)
        i = end


def parse_cpp(src: str, api: Api) -> None:
    src = strip_comments(src)
    variables: dict[str, str] = {}  # a binding kept in a variable -> its class name
    for m in _BINDING.finditer(src):
        kind = m.group(1)
        after_template = balanced(src, m.end() - 1)
        v = re.compile(r"\s*(\w+)?\s*([({])").match(src, after_template)
        if not v:
            continue
        end = balanced(src, v.end() - 1)
        args = split_args(src[v.end() : end - 1])
        if len(args) < 2 or literal(args[1]) is None:
            continue
        parent, name = args[0], str(literal(args[1]))
        full = name if parent == "m" else f"{variables.get(parent, parent)}.{name}"
        if parent == "m":
            api.module.add(name)
        else:
            api.member(variables.get(parent, parent), name)
        api.classes.setdefault(full, set())
        if kind == "enum_":
            api.enums.add(full)
        if v.group(1):
            variables[v.group(1)] = full
        else:  # a binding assigned to a variable: ``auto x = py::class_<...>(...)``
            before = re.search(r"(\w+)\s*=\s*$", src[max(0, m.start() - 80) : m.start()])
            if before:
                variables[before.group(1)] = full
        _chain(src, end, api, full, "" if parent == "m" else variables.get(parent, parent))
    for var, cls in variables.items():
        for use in re.finditer(rf"\b{re.escape(var)}(?=\s*\.\s*(?:def\w*|value)\s*\()", src):
            _chain(src, use.end(), api, cls)
    for use in re.finditer(r"\bm\s*\.\s*(def|attr)\s*\(", src):
        end = balanced(src, use.end() - 1)
        args = split_args(src[use.end() : end - 1])
        module_name = literal(args[0]) if args else None
        if module_name is not None:
            api.module.add(module_name)


def parse_init(src: str, api: Api) -> None:
    """The Python half of the package: what its ``__init__.py`` defines at the top level (its
    build fills in ``##PLACEHOLDERS##``; as identifiers they parse)."""
    for node in ast.parse(re.sub(r"##(\w+)##", r"\1", src)).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            api.module.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    api.module.add(target.id)
                elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                    api.member(target.value.id, target.attr)
        elif isinstance(node, ast.For):
            _copied_members(node, api)


def _copied_members(loop: ast.For, api: Api) -> None:
    """``for attr, value in ILogger.Severity.__members__.items(): setattr(Logger, attr, value)``:
    the enum's values become the class's attributes."""
    it = loop.iter
    if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr == "items"):
        return
    members = it.func.value
    if not (isinstance(members, ast.Attribute) and members.attr == "__members__"):
        return
    source = ast.unparse(members.value)
    for stmt in ast.walk(loop):
        if (
            isinstance(stmt, ast.Call)
            and isinstance(stmt.func, ast.Name)
            and stmt.func.id == "setattr"
            and stmt.args
            and isinstance(stmt.args[0], ast.Name)
        ):
            for value in api.classes.get(source, set()) - set(ENUM_IMPLICIT):
                api.member(stmt.args[0].id, value)


def init_paths(repo: Path, ref: str) -> list[str]:
    """The package's ``__init__.py`` at this commit (8.x: packaging/tensorrt; 10+: bindings_wheel)."""
    names = git(repo, "ls-tree", "-r", "--name-only", ref, "python/packaging").split()
    wanted = ("python/packaging/tensorrt/__init__.py", "python/packaging/bindings_wheel/tensorrt/__init__.py")
    return [n for n in names if n in wanted]


def header_version(repo: Path, ref: str) -> str:
    text = git(repo, "show", f"{ref}:include/NvInferVersion.h")
    parts = []
    for key in ("MAJOR", "MINOR", "PATCH", "BUILD"):
        m = re.search(rf"#define\s+(?:NV_)?TENSORRT_{key}\s+(\d+)", text)
        if not m:  # 10.13 and later name them TRT_..._ENTERPRISE
            m = re.search(rf"#define\s+TRT_{key}_ENTERPRISE\s+(\d+)", text)
        parts.append(m.group(1) if m else "?")
    return ".".join(parts)


def read_release(repo: Path, ref: str) -> dict[str, object]:
    commit = git(repo, "rev-parse", f"{ref}^{{commit}}").strip()
    api = Api()
    sources = [p for p in git(repo, "ls-tree", "-r", "--name-only", commit, "python/src").split() if p.endswith(".cpp")]
    for path in sources:
        parse_cpp(git(repo, "show", f"{commit}:{path}"), api)
    for path in init_paths(repo, commit):
        parse_init(git(repo, "show", f"{commit}:{path}"), api)
    for enum in api.enums:
        for name in ENUM_IMPLICIT:
            api.member(enum, name)
    return {
        "commit": commit,
        "version": header_version(repo, commit),
        "sources": sorted(sources),
        "module": sorted(api.module),
        "enums": sorted(api.enums),
        "classes": {cls: sorted(members) for cls, members in sorted(api.classes.items())},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("repo", type=Path, help="a clone of github.com/NVIDIA/TensorRT")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    releases = {release: read_release(args.repo, ref) for release, ref in RELEASES.items()}
    data = {
        "about": (
            "The tensorrt Python module's names per release, read from the pybind11 sources of "
            "github.com/NVIDIA/TensorRT by scripts/trt_api_manifest.py; do not edit by hand"
        ),
        "releases": releases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    for release, info in releases.items():
        classes = info["classes"]
        assert isinstance(classes, dict)
        members = sum(len(v) for v in classes.values())
        sys.stderr.write(f"{release}: {info['version']}, {len(classes)} classes, {members} members\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
