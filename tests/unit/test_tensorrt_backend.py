"""The TensorRT backend's parts that run without TensorRT: availability, import isolation,
model inspection, timing cache naming, and the type check against the
official stubs (which is what stands in for running it here)."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from edged.backends import resolve
from edged.backends.tensorrt import TensorRTBackend
from edged.backends.tensorrt.timing import timing_cache_path
from edged.backends.tensorrt.versions import read_model_traits
from tests.helpers import tensorrt_installed, unavailable

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "edged" / "backends" / "tensorrt"


needs_no_tensorrt = pytest.mark.skipif(tensorrt_installed(), reason="TensorRT is installed here")


@needs_no_tensorrt
def test_available_says_why_not_instead_of_raising() -> None:
    ok, why = TensorRTBackend.available()
    assert ok is False
    assert "tensorrt" in why


@needs_no_tensorrt
def test_auto_falls_back_to_onnxruntime_and_says_why() -> None:
    cls, why = resolve("auto")
    assert cls.name == "onnxruntime"
    assert "skipped" in why and "tensorrt" in why


def _imported_roots(tree: ast.AST) -> set[str]:
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                roots.add(arg.value.split(".")[0])
    return roots


def test_only_the_tensorrt_package_imports_tensorrt_or_pycuda() -> None:
    offenders = []
    for path in (REPO / "edged").rglob("*.py"):
        if PACKAGE in path.parents:
            continue
        roots = _imported_roots(ast.parse(path.read_text(), str(path)))
        offenders += [f"{path.relative_to(REPO)}: {r}" for r in roots & {"tensorrt", "pycuda"}]
    assert offenders == []
    # ...and the package itself does import them, so the scan above is looking at real imports.
    inside = set().union(*(_imported_roots(ast.parse(p.read_text())) for p in PACKAGE.glob("*.py")))
    assert {"tensorrt", "pycuda"} <= inside


def test_importing_the_backend_loads_neither_library() -> None:
    code = (
        "import sys, edged.backends.tensorrt as m; "
        "bad = [k for k in sys.modules if k == 'tensorrt' or k.split('.')[0] == 'pycuda']; "
        "print(m.TensorRTBackend.name, bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert out.strip() == "tensorrt []"


def _model(path: Path, nodes: list[str]) -> str:
    import onnx
    from onnx import TensorProto, helper

    scale = helper.make_tensor("s", TensorProto.FLOAT, [], [0.05])
    zero = helper.make_tensor("z", TensorProto.INT8, [], [0])
    made = {
        "relu": [helper.make_node("Relu", ["x"], ["y"])],
        "qdq": [
            helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
            helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"]),
        ],
        "fp16": [
            helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16),
            helper.make_node("Cast", ["h"], ["y"], to=TensorProto.FLOAT),
        ],
    }
    graph = helper.make_graph(
        [n for kind in nodes for n in made[kind]],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [scale, zero],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return str(path)


def test_model_traits_see_qdq_nodes_and_fp16(tmp_path: Path) -> None:
    plain = read_model_traits(_model(tmp_path / "plain.onnx", ["relu"]))
    qdq = read_model_traits(_model(tmp_path / "qdq.onnx", ["qdq"]))
    half = read_model_traits(_model(tmp_path / "half.onnx", ["fp16"]))
    assert (plain.qdq, plain.fp16) == (False, False)
    assert (qdq.qdq, qdq.fp16) == (True, False)
    assert (half.qdq, half.fp16) == (False, True)


def test_timing_cache_is_kept_per_device_fingerprint(tmp_path: Path) -> None:
    orin = {"tensorrt": "10.3.0.30", "gpu": "Orin", "l4t": "36.4.3"}
    a = timing_cache_path("", tmp_path, orin)
    assert a.parent == tmp_path / "timing"
    assert a == timing_cache_path("", tmp_path, dict(orin))
    assert a != timing_cache_path("", tmp_path, dict(orin, tensorrt="10.3.0.31"))
    assert timing_cache_path(str(tmp_path / "t.cache"), tmp_path, orin) == tmp_path / "t.cache"


# --- the type check against the official stubs --------------------------------------------------

_MYPY_INI = """\
[mypy]
python_version = 3.10
mypy_path = {stubs}
ignore_missing_imports = True
warn_unused_ignores = True
cache_dir = {cache}

[mypy-edged.backends.tensorrt,edged.backends.tensorrt.*,trt_misuse]
strict = True
ignore_missing_imports = False
# numpy < 2 makes a bare ndarray an error under strict; the check is about TensorRT's API.
disallow_any_generics = False

[mypy-tensorrt,tensorrt.*,tensorrt_bindings,tensorrt_bindings.*]
ignore_errors = True
"""


def _stubs(dest: Path) -> Path:
    """A copy of the ``tensorrt-stubs`` package mypy can read: the package lacks the PEP 561
    marker, and five generated signatures are not valid Python (a parameter named ``in``, a
    required parameter after defaults), in plugin APIs edged does not use."""
    try:
        dist = importlib.metadata.distribution("tensorrt-stubs")
    except importlib.metadata.PackageNotFoundError:
        unavailable("the tensorrt-stubs package is not installed (pip install --no-deps tensorrt-stubs)")
    for rel in ("tensorrt/__init__.pyi", "tensorrt_bindings/__init__.pyi", "tensorrt_bindings/tensorrt.pyi"):
        text = Path(str(dist.locate_file(rel))).read_text()
        text = re.sub(r"([(,] ?)in: ", r"\1in_: ", text)
        text = re.sub(r"(= None, channel_axis: int)\)", r"\1 = ...)", text)
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_text(text)
    return dest


def _mypy(tmp_path: Path, *targets: str) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec("mypy") is None:
        unavailable("mypy is not installed")
    ini = tmp_path / "mypy.ini"
    ini.write_text(_MYPY_INI.format(stubs=_stubs(tmp_path / "stubs"), cache=tmp_path / "cache"))
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ini), *targets], capture_output=True, text=True, cwd=REPO
    )


@pytest.mark.slow
def test_the_package_type_checks_strictly_against_the_tensorrt_stubs(tmp_path: Path) -> None:
    run = _mypy(tmp_path, "-p", "edged.backends.tensorrt")
    mine = [line for line in run.stdout.splitlines() if "edged/backends/tensorrt" in line]
    assert mine == [], run.stdout
    assert "checked" in run.stdout or "Success" in run.stdout, run.stdout + run.stderr


@pytest.mark.slow
def test_the_stub_check_catches_removed_apis(tmp_path: Path) -> None:
    """The control: code using the pre-8.5 bindings API and build_engine fails the same check,
    so a passing check above means the stubs were read, not silently skipped."""
    misuse = tmp_path / "trt_misuse.py"
    misuse.write_text(
        textwrap.dedent("""\
        import tensorrt as trt

        def old(builder: trt.Builder, network: trt.INetworkDefinition,
                config: trt.IBuilderConfig, engine: trt.ICudaEngine) -> None:
            builder.build_engine(network, config)
            engine.get_binding_shape(0)
            engine.max_batch_size
    """)
    )
    run = _mypy(tmp_path, str(misuse))
    for api in ("build_engine", "get_binding_shape", "max_batch_size"):
        assert f'has no attribute "{api}"' in run.stdout, run.stdout + run.stderr


def test_int64_is_narrowed_for_an_input_tensorrt_8_made_int32() -> None:
    """A loaded engine (its state set as ``_load_impl`` sets it) whose ``ids`` input TensorRT 8.x
    typed INT32: the build's gate feeds INT64 and is served; values INT32 cannot hold are refused."""
    from edged.backends.base import TensorSpec
    from edged.errors import InvalidInputError
    from edged.wire.validate import rules_of

    backend = TensorRTBackend(Path("fake.engine"))
    spec = TensorSpec("ids", "int32", (-1, 4))
    backend._profiles = {"ids": ((1, 4), (2, 4), (8, 4))}
    backend._inputs, backend._rules, backend._loaded = (spec,), rules_of((spec,), backend._input_bounds()), True
    backend._int32_inputs = frozenset({"ids"})
    ids = np.arange(8, dtype=np.int64).reshape(2, 4)
    backend.check_inputs({"ids": ids})
    narrowed = backend.narrowed({"ids": ids})["ids"]
    assert narrowed.dtype == np.int32 and narrowed.tolist() == ids.tolist()
    with pytest.raises(InvalidInputError, match="outside int32"):
        backend.check_inputs({"ids": np.full((1, 4), 2**40, np.int64)})
    with pytest.raises(InvalidInputError, match="expected datatype INT32"):
        backend.check_inputs({"ids": np.zeros((1, 4), np.float32)})  # only INT64 is narrowed
    # The engine's profile is the backend's own bound, checked by the shared rules.
    with pytest.raises(InvalidInputError, match=r"outside the profile \[1, 4\]..\[8, 4\] \(dim 0 is 9, not 1..8\)"):
        backend.check_inputs({"ids": np.zeros((9, 4), np.int64)})


@needs_no_tensorrt
def test_on_a_jetson_the_reason_says_what_makes_tensorrt_import(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from edged.backends.tensorrt import backend as backend_mod

    release = tmp_path / "nv_tegra_release"
    monkeypatch.setattr(backend_mod, "TEGRA_RELEASE", str(release))
    assert "scripts/install.sh" not in TensorRTBackend.available()[1]  # not a Jetson
    release.write_text("# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref, EABI: aarch64\n")
    why = TensorRTBackend.available()[1]
    assert why.endswith(
        f"; on a Jetson, scripts/install.sh --python {sys.executable} makes JetPack's TensorRT import under this "
        "Python (JetPack 5: it builds the bindings for it; docs/tensorrt.md#what-it-needs)"
    )
