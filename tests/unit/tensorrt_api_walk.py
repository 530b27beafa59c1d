"""The means to hold every TensorRT name the backend touches to every release it can run on: the
manifest of each release's names, the member types the stubs declare, and the walk of the backend
that finds each name it uses and the releases each use can run on. The tests are
test_tensorrt_release_names.py and test_tensorrt_api_manifest.py.

The strict mypy run (test_tensorrt_backend.py) checks the backend against one release's stubs
(10.13). This check holds it to all of them: ``scripts/data/tensorrt_api.json`` lists the
``tensorrt`` module's names per release (8.5, 8.6, 10.3, 10.13, 11.0, 11.1), read by
``scripts/trt_api_manifest.py`` from the pybind11 sources of NVIDIA's TensorRT repository at each
release's commit. An AST walk of ``edged/backends/tensorrt/`` finds each attribute read or set on
``trt.`` and on TensorRT objects (a builder, config, network, engine, context...: typed from the
backend's own annotations, its local assignments and the stubs' return types), and the releases
each one can run on: all of them, less those a version check of ``versions.VERSION_CHECKS`` rules
out (an ``if``, a conditional expression, the right side of an ``and``, or an early ``raise``/
``return`` that leaves the rest of a function to the releases it admits). Each name must exist
in each release it can run on. Annotations are left out: under ``from __future__ import
annotations`` (every module has it) they are never evaluated.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from edged.backends.tensorrt.versions import VERSION_CHECKS, Version, parse_version
from tests.helpers import unavailable

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "edged" / "backends" / "tensorrt"
MANIFEST = REPO / "scripts" / "data" / "tensorrt_api.json"
MODULE = ""  # the owner of a module-level name (``trt.Builder``)
# The package's Protocols stand for TensorRT classes (they type what a function asks of one).
PROTOCOLS = {"ContextLike": "IExecutionContext", "DimsLike": "Dims"}


@dataclass(frozen=True)
class Use:
    where: str  # file:line
    owner: str  # a TensorRT class, or MODULE
    name: str
    releases: frozenset[str]  # the releases this use can run on


@cache
def manifest() -> dict[str, dict[str, object]]:
    data: dict[str, dict[str, dict[str, object]]] = json.loads(MANIFEST.read_text())
    return data["releases"]


def release_versions() -> dict[str, Version]:
    return {name: parse_version(str(info["version"])) for name, info in manifest().items()}


def exists(release: str, owner: str, name: str) -> bool:
    info = manifest()[release]
    if owner == MODULE:
        return name in info["module"]  # type: ignore[operator]
    classes: dict[str, list[str]] = info["classes"]  # type: ignore[assignment]
    return name in classes.get(owner, ())


# --- what the stubs say each member returns (for typing the receivers) ----------------------------


def _stub_source() -> str:
    try:
        dist = importlib.metadata.distribution("tensorrt-stubs")
    except importlib.metadata.PackageNotFoundError:
        unavailable("the tensorrt-stubs package is not installed (pip install --no-deps tensorrt-stubs)")
    text = Path(str(dist.locate_file("tensorrt_bindings/tensorrt.pyi"))).read_text()
    # Five generated signatures are not valid Python (see test_tensorrt_backend._stubs).
    text = re.sub(r"([(,] ?)in: ", r"\1in_: ", text)
    return re.sub(r"(= None, channel_axis: int)\)", r"\1 = ...)", text)


def _class_in(annotation: ast.expr | None, known: Mapping[str, object]) -> str | None:
    """The TensorRT class an annotation names (``X``, ``X | None``, ``trt.X``), if any."""
    if annotation is None:
        return None
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return _class_in(ast.parse(annotation.value, mode="eval").body, known)
    if isinstance(annotation, ast.Name):
        name = PROTOCOLS.get(annotation.id, annotation.id)
        return name if name in known else None
    if isinstance(annotation, ast.Attribute) and isinstance(annotation.value, ast.Name):
        if annotation.value.id in ("trt", "tensorrt"):
            return annotation.attr if annotation.attr in known else None
        return None
    if isinstance(annotation, ast.BinOp):  # X | None
        return _class_in(annotation.left, known) or _class_in(annotation.right, known)
    return None


@cache
def stub_types() -> dict[str, dict[str, str]]:
    """class -> member -> the TensorRT class it returns (methods) or holds (properties)."""
    tree = ast.parse(_stub_source())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    types: dict[str, dict[str, str]] = {}
    for name, node in classes.items():
        members: dict[str, str] = {}
        for item in node.body:
            found = None
            if isinstance(item, ast.FunctionDef):
                found = _class_in(item.returns, classes)
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                found = _class_in(item.annotation, classes)
            target = (
                item.name if isinstance(item, ast.FunctionDef) else getattr(getattr(item, "target", None), "id", "")
            )
            if found and target:
                members[target] = found
        types[name] = members
    return types


# --- the walk -------------------------------------------------------------------------------------


class _Check:
    """Three-valued truth of a test on each release: True, False or None (not a version check)."""

    def __init__(self, versions: Mapping[str, Version], env_checks: Mapping[str, ast.expr]) -> None:
        self.versions = versions
        self.aliases = env_checks  # local names bound to a version check's result

    def value(self, test: ast.expr, release: str) -> bool | None:
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            inner = self.value(test.operand, release)
            return None if inner is None else not inner
        if isinstance(test, ast.BoolOp):
            values = [self.value(v, release) for v in test.values]
            if isinstance(test.op, ast.And):
                return False if False in values else (True if all(values) else None)
            return True if True in values else (False if all(v is False for v in values) else None)
        if isinstance(test, ast.Name) and test.id in self.aliases:
            return self.value(self.aliases[test.id], release)
        if isinstance(test, ast.Call):
            func = test.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name in VERSION_CHECKS:
                return VERSION_CHECKS[name](self.versions[release])
        return None

    def split(self, test: ast.expr, releases: frozenset[str]) -> tuple[frozenset[str], frozenset[str]]:
        """(releases where the test may be true, releases where it may be false)."""
        values = {r: self.value(test, r) for r in releases}
        return (
            frozenset(r for r, v in values.items() if v is not False),
            frozenset(r for r, v in values.items() if v is not True),
        )


def _terminates(body: Sequence[ast.stmt]) -> bool:
    return bool(body) and isinstance(body[-1], (ast.Raise, ast.Return, ast.Continue, ast.Break))


class Walker:
    """One module: its functions' TensorRT uses and the releases each runs on."""

    def __init__(self, path: Path, returns: Mapping[str, ast.expr | None]) -> None:
        self.path = path
        self.returns = returns  # the package's functions and methods by name: their return annotations
        self.types = stub_types()
        self.versions = release_versions()
        self.uses: list[Use] = []
        self.self_attrs: dict[str, str] = {}

    # types -------------------------------------------------------------------------------------

    def type_of(self, expr: ast.expr, env: Mapping[str, str]) -> str | None:
        """The TensorRT class of an expression's value ("trt" for the module itself)."""
        if isinstance(expr, ast.Name):
            return env.get(expr.id)
        if isinstance(expr, ast.Attribute):
            if isinstance(expr.value, ast.Name) and expr.value.id in ("self", "cls"):
                return self.self_attrs.get(expr.attr)
            owner = self.type_of(expr.value, env)
            if owner == "trt":
                return expr.attr if expr.attr in self.types else None
            return self.types.get(owner or "", {}).get(expr.attr)
        if isinstance(expr, ast.Call):
            func = expr.func
            if isinstance(func, ast.Attribute):
                owner = self.type_of(func.value, env)
                if owner == "trt":
                    return func.attr if func.attr in self.types else None  # a constructor
                if owner is not None:
                    return self.types.get(owner, {}).get(func.attr)
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            return _class_in(self.returns.get(name), self.types)
        return None

    def _tuple_types(self, value: ast.expr, env: Mapping[str, str]) -> list[str | None]:
        if isinstance(value, ast.Tuple):
            return [self.type_of(e, env) for e in value.elts]
        if isinstance(value, ast.Call):
            func = value.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            ann = self.returns.get(name)
            if isinstance(ann, ast.Subscript) and isinstance(ann.slice, ast.Tuple):
                return [_class_in(e, self.types) for e in ann.slice.elts]
        return []

    def bind(self, target: ast.expr, value: ast.expr, env: dict[str, str]) -> None:
        if isinstance(target, ast.Name):
            found = self.type_of(value, env)
            if found:
                env[target.id] = found
        elif isinstance(target, ast.Tuple):
            for t, found in zip(target.elts, self._tuple_types(value, env)):
                if isinstance(t, ast.Name) and found:
                    env[t.id] = found

    # uses --------------------------------------------------------------------------------------

    def expr(self, node: ast.expr | None, releases: frozenset[str], env: dict[str, str], checks: _Check) -> None:
        if node is None:
            return
        if isinstance(node, ast.IfExp):
            self.expr(node.test, releases, env, checks)
            yes, no = checks.split(node.test, releases)
            self.expr(node.body, yes, env, checks)
            self.expr(node.orelse, no, env, checks)
            return
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And):
            for value in node.values:  # each operand runs only where those before it were true
                self.expr(value, releases, env, checks)
                releases = checks.split(value, releases)[0]
            return
        if isinstance(node, ast.Lambda):
            return
        if isinstance(node, ast.Attribute):
            owner = self.type_of(node.value, env)
            if owner is not None:
                self.uses.append(
                    Use(f"{self.path.name}:{node.lineno}", MODULE if owner == "trt" else owner, node.attr, releases)
                )
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.expr):
                self.expr(child, releases, env, checks)
            elif isinstance(child, ast.keyword):
                self.expr(child.value, releases, env, checks)
            elif isinstance(child, ast.comprehension):
                for part in (child.iter, child.target, *child.ifs):
                    self.expr(part, releases, env, checks)

    def block(self, body: Sequence[ast.stmt], releases: frozenset[str], env: dict[str, str], checks: _Check) -> None:
        for stmt in body:
            if isinstance(stmt, ast.If):
                if _is_type_checking(stmt.test):
                    continue
                self.expr(stmt.test, releases, env, checks)
                yes, no = checks.split(stmt.test, releases)
                self.block(stmt.body, yes, env, checks)
                self.block(stmt.orelse, no, env, checks)
                if _terminates(stmt.body) and not stmt.orelse:
                    releases = no  # the rest runs only where the test was false
                continue
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.function(stmt, releases, env)
                continue
            if isinstance(stmt, ast.ClassDef):
                for base in stmt.bases:
                    self.expr(base, releases, env, checks)
                self.block(stmt.body, releases, dict(env), checks)
                continue
            if isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if alias.name == "tensorrt":
                        env[alias.asname or alias.name] = "trt"
                continue
            if isinstance(stmt, ast.Assign):
                self.expr(stmt.value, releases, env, checks)
                for target in stmt.targets:
                    self.expr(target, releases, env, checks)
                    self.bind(target, stmt.value, env)
                    if (
                        isinstance(target, ast.Name)
                        and checks.value(stmt.value, next(iter(checks.versions))) is not None
                    ):
                        checks.aliases = {**checks.aliases, target.id: stmt.value}
                continue
            if isinstance(stmt, ast.AnnAssign):  # the annotation is never evaluated
                self.expr(stmt.value, releases, env, checks)
                found = _class_in(stmt.annotation, self.types)
                if isinstance(stmt.target, ast.Attribute) and isinstance(stmt.target.value, ast.Name):
                    if stmt.target.value.id == "self" and found:
                        self.self_attrs[stmt.target.attr] = found
                elif isinstance(stmt.target, ast.Name) and found:
                    env[stmt.target.id] = found
                continue
            self._statement_fields(stmt, releases, env, checks)

    def _statement_fields(self, stmt: ast.stmt, releases: frozenset[str], env: dict[str, str], checks: _Check) -> None:
        """Any other statement: the expressions in its fields, and the statements nested there (the
        bodies of a loop, a ``with``, a ``try`` and its handlers)."""
        for field_name, value in ast.iter_fields(stmt):
            if isinstance(value, ast.expr):
                self.expr(value, releases, env, checks)
            elif isinstance(value, list):
                stmts = [v for v in value if isinstance(v, ast.stmt)]
                if stmts:
                    self.block(stmts, releases, env, checks)
                for v in value:
                    if isinstance(v, ast.expr):
                        self.expr(v, releases, env, checks)
                    elif isinstance(v, ast.withitem):
                        self.expr(v.context_expr, releases, env, checks)
                    elif isinstance(v, ast.ExceptHandler):
                        self.block(v.body, releases, env, checks)
            del field_name

    def function(
        self, node: ast.FunctionDef | ast.AsyncFunctionDef, releases: frozenset[str], outer: dict[str, str]
    ) -> None:
        env = dict(outer)
        args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        for arg in args:
            found = _class_in(arg.annotation, self.types)
            if found:
                env[arg.arg] = found
        for default in [*node.args.defaults, *node.args.kw_defaults]:
            self.expr(default, releases, env, _Check(self.versions, {}))
        self.block(node.body, releases, env, _Check(self.versions, {}))

    def module(self, tree: ast.Module) -> None:
        every = frozenset(self.versions)
        # ``self._x: trt.X`` annotations first: methods use attributes set in ``__init__``.
        for node in ast.walk(tree):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Attribute):
                found = _class_in(node.annotation, self.types)
                if found and isinstance(node.target.value, ast.Name) and node.target.value.id == "self":
                    self.self_attrs[node.target.attr] = found
        self.block(tree.body, every, {}, _Check(self.versions, {}))


def _is_type_checking(test: ast.expr) -> bool:
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"


def package_uses(package: Path) -> list[Use]:
    trees = {path: ast.parse(path.read_text(), str(path)) for path in sorted(package.glob("*.py"))}
    returns: dict[str, ast.expr | None] = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                returns.setdefault(node.name, node.returns)
    uses: list[Use] = []
    for path, tree in trees.items():
        walker = Walker(path, returns)
        walker.module(tree)
        uses += walker.uses
    return uses


def missing(uses: Sequence[Use]) -> list[str]:
    """``file:line: Owner.name is not in TensorRT 8.5, 11.1`` for every name a release lacks."""
    found = []
    for use in uses:
        lacking = sorted((r for r in use.releases if not exists(r, use.owner, use.name)), key=parse_version)
        if lacking:
            what = f"{use.owner}.{use.name}" if use.owner else f"trt.{use.name}"
            found.append(f"{use.where}: {what} is not in TensorRT {', '.join(lacking)}")
    return found
