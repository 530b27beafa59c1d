"""``build_engine``'s wiring per TensorRT version, against ``FakeTensorRT``: a fake module for this
unit test of pure logic (it records calls; it builds nothing and knows none of TensorRT's
semantics beyond the calibrator's callback loop). What it checks: the flags, preview features and
profile copies each version's plan asks for reach the builder config; the model handed to the
parser; the legacy calibrator fed from the loader's samples with a bad one failing the build by
name; the layers DLA cannot run recorded. TensorRT's API names themselves are checked by the
strict mypy run against the official stubs (test_tensorrt_backend.py)."""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from edged.backends.base import BuildSpec, TensorSpec
from edged.backends.tensorrt import calibrator as calibrator_mod
from edged.backends.tensorrt import trtlog
from edged.backends.tensorrt.build import build_engine
from edged.backends.tensorrt.timing import timing_cache_path
from edged.config import CalibrationConfig
from edged.errors import BuildError
from edged.quantize.calibrate import CalibrationSet

PROFILE = {"x": ((1, 16), (4, 16), (8, 16))}


class _Enum:
    def __init__(self, name: str, value: int = 0) -> None:
        self.name, self.value = name, value

    def __int__(self) -> int:
        return self.value

    def __repr__(self) -> str:
        return self.name


def _members(*names: str) -> Any:
    return types.SimpleNamespace(**{n: _Enum(n, i) for i, n in enumerate(names)})


class FakeTensorRT(types.ModuleType):
    """The fake ``tensorrt`` module; ``calls`` records what the build asked of it."""

    parsed_model: onnx.ModelProto  # what the fake parser read, set by parse_from_file

    def __init__(
        self,
        version: str,
        dla_cores: int = 0,
        layers: tuple[str, ...] = ("fc1", "relu", "fc2"),
        fail_fp16: str = "",
        reject_timing: bytes = b"",
    ) -> None:
        """``fail_fp16``: "parse" or "build" fails for a model holding FP16 tensors (as a
        strongly typed build might); ``reject_timing``: a timing cache TensorRT refuses."""
        super().__init__("tensorrt")
        self.__version__ = version
        self.calls: list[tuple[Any, ...]] = []
        self.parsed: list[str] = []
        self.fed: list[np.ndarray] = []
        fake = self
        self.NetworkDefinitionCreationFlag = _members("EXPLICIT_BATCH", "STRONGLY_TYPED")
        self.BuilderFlag = _members("FP16", "INT8", "GPU_FALLBACK")
        self.PreviewFeature = _members("PROFILE_SHARING_0806")
        self.MemoryPoolType = _members("WORKSPACE")
        self.DeviceType = _members("GPU", "DLA")
        self.Dims = lambda shape: tuple(shape)

        class ILogger:
            Severity = int

            def __init__(self) -> None:
                pass

        class IInt8EntropyCalibrator2:
            def __init__(self) -> None:
                pass

        self.ILogger, self.IInt8EntropyCalibrator2 = ILogger, IInt8EntropyCalibrator2

        class Tensor:
            name, shape, dtype = "x", (-1, 16), _Enum("FLOAT")

        class Layer:
            def __init__(self, name: str) -> None:
                self.name = name

        class Network:
            num_inputs, num_layers = 1, len(layers)

            def get_input(self, i: int) -> Tensor:
                return Tensor()

            def get_layer(self, i: int) -> Layer:
                return Layer(layers[i])

        def has_fp16(model: onnx.ModelProto) -> bool:
            return any(i.data_type == onnx.TensorProto.FLOAT16 for i in model.graph.initializer)

        class Parser:
            def __init__(self, network: Network, logger: Any) -> None:
                self.num_errors = 0

            def parse_from_file(self, path: str) -> bool:
                fake.parsed.append(path)
                fake.parsed_model = onnx.load(path)
                if fail_fp16 == "parse" and has_fp16(fake.parsed_model):
                    self.num_errors = 1
                    return False
                return True

            def get_error(self, i: int) -> str:
                return "In node 7 (parseGraph): the FP16 Q/DQ scale is not supported here"

        class TimingCache:
            def __init__(self, data: bytes) -> None:
                self.data = data

            def serialize(self) -> bytes:
                return self.data + b"timings;"

        class Config:
            int8_calibrator: Any = None
            default_device_type: Any = None
            DLA_core = -1
            builder_optimization_level = 3

            def __getattribute__(self, name: str) -> Any:
                attr = object.__getattribute__(self, name)
                if callable(attr) and not name.startswith("_"):

                    def recorded(*a: Any) -> Any:
                        fake.calls.append((name, *a))
                        return attr(*a)

                    return recorded
                return attr

            def set_memory_pool_limit(self, pool: Any, size: int) -> None: ...
            def set_flag(self, flag: Any) -> None: ...
            def set_preview_feature(self, feature: Any, on: bool) -> None: ...
            def set_calibration_profile(self, profile: Any) -> None: ...
            def set_timing_cache(self, cache: TimingCache, ignore: bool) -> bool:
                self._timing = cache
                return not (reject_timing and cache.data == reject_timing)

            def create_timing_cache(self, data: bytes) -> TimingCache:
                return TimingCache(bytes(data))

            def get_timing_cache(self) -> TimingCache:
                return self._timing

            def add_optimization_profile(self, profile: Any) -> int:
                return sum(1 for c in fake.calls if c[0] == "add_optimization_profile") - 1

            def can_run_on_DLA(self, layer: Layer) -> bool:
                return layer.name != "relu"

        class Profile:
            def set_shape(self, name: str, lo: Any, opt: Any, hi: Any) -> None:
                fake.calls.append(("set_shape", name, lo, opt, hi))

        class Builder:
            num_DLA_cores = dla_cores

            def __init__(self, logger: Any) -> None:
                pass

            def create_network(self, flags: int) -> Network:
                fake.calls.append(("create_network", flags))
                return Network()

            def create_builder_config(self) -> Config:
                return Config()

            def create_optimization_profile(self) -> Profile:
                return Profile()

            def build_serialized_network(self, network: Network, config: Config) -> bytes | None:
                if fail_fp16 == "build" and has_fp16(fake.parsed_model):
                    trtlog.record(1, "Error Code 10: Could not find any implementation for node conv1")
                    return None
                calibrator = config.int8_calibrator
                while calibrator is not None and calibrator.get_batch(["x"]):
                    pass  # TensorRT's calibration loop: until get_batch returns no pointers
                if calibrator is not None:
                    calibrator.write_calibration_cache(b"scales")
                return b"engine"

        self.Builder, self.OnnxParser = Builder, Parser


@pytest.fixture
def fake_trt(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    def install(version: str, **kw: Any) -> FakeTensorRT:
        module = FakeTensorRT(version, **kw)
        monkeypatch.setitem(sys.modules, "tensorrt", module)
        monkeypatch.setattr(trtlog, "_logger", None)  # the bridge subclasses this module's ILogger
        return module

    yield install
    trtlog._logger = None


@pytest.fixture
def mlp(tmp_path: Path) -> Path:
    from edged.tools.demo import make_tiny_mlp

    return make_tiny_mlp(tmp_path / "mlp.onnx")


@pytest.fixture
def qdq(mlp: Path, tmp_path: Path) -> Path:
    from edged.tools.selftest import selftest_qdq, synthetic_feeds

    return selftest_qdq(mlp, tmp_path / "mlp.qdq.onnx", synthetic_feeds([("x", (4, 16), "float32")], 8, seed=1))


def named(fake: FakeTensorRT, call: str) -> list[tuple[Any, ...]]:
    return [c[1:] for c in fake.calls if c[0] == call]


def test_8_5_builds_one_profile_per_instance(fake_trt: Any, mlp: Path, tmp_path: Path) -> None:
    fake = fake_trt("8.5.2.2")
    extra = build_engine(BuildSpec(str(mlp), "fp32", PROFILE, {"instances": 3}), tmp_path / "e", print, {})
    assert len(named(fake, "add_optimization_profile")) == 3
    assert len(named(fake, "set_shape")) == 3 and named(fake, "set_preview_feature") == []
    assert extra["profiles_per_input"] == 3 and (tmp_path / "e").read_bytes() == b"engine"
    assert named(fake, "create_network") == [(1 << 0,)]  # EXPLICIT_BATCH


def test_8_6_enables_profile_sharing(fake_trt: Any, qdq: Path, tmp_path: Path) -> None:
    fake = fake_trt("8.6.1.6")
    extra = build_engine(BuildSpec(str(qdq), "int8", PROFILE, {"instances": 3}), tmp_path / "e", print, {})
    assert [repr(f) for f, on in named(fake, "set_preview_feature")] == ["PROFILE_SHARING_0806"]
    assert len(named(fake, "add_optimization_profile")) == 1
    assert sorted(repr(f[0]) for f in named(fake, "set_flag")) == ["FP16", "INT8"]
    assert fake.parsed == [str(qdq)] and extra["float_parts"] == "builder flags"


def test_10_parses_the_fp16_converted_qdq_model(fake_trt: Any, qdq: Path, tmp_path: Path) -> None:
    fake = fake_trt("10.3.0.30")
    extra = build_engine(BuildSpec(str(qdq), "int8", PROFILE, {}), tmp_path / "e", print, {})
    assert named(fake, "create_network") == [(1 << 1,)]  # STRONGLY_TYPED
    assert named(fake, "set_flag") == [] and named(fake, "set_preview_feature") == []
    assert fake.parsed[0] != str(qdq) and extra["float_parts"] == "fp16"
    gemms = [n for n in fake.parsed_model.graph.node if n.op_type == "Gemm"]
    inits = {i.name: i.data_type for i in fake.parsed_model.graph.initializer}
    assert gemms and all(inits.get(g.input[2]) == onnx.TensorProto.FLOAT16 for g in gemms)  # FP16 biases
    assert not Path(fake.parsed[0]).exists()  # the converted copy is gone after the parse


def samples(tmp_path: Path, bad: bool = False) -> CalibrationSet:
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for i in range(5):
        rows = 3 if bad and i == 2 else 4
        np.save(data / f"{i:02}.npy", rng.standard_normal((rows, 16), dtype=np.float32))
    return CalibrationSet.load(CalibrationConfig(data=str(data)), [TensorSpec("x", "float32", (-1, 16))])


class FakeCuda:
    """Fake of pycuda.driver for the calibrator's uploads (unit test stand-in)."""

    def __init__(self, fake: FakeTensorRT) -> None:
        self.fake = fake

    def mem_alloc(self, nbytes: int) -> int:
        return 4096

    def memcpy_htod(self, dest: int, arr: np.ndarray) -> None:
        self.fake.fed.append(arr.copy())


def test_legacy_calibrator_is_fed_from_the_loader(
    fake_trt: Any, mlp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = fake_trt("10.3.0.30")
    monkeypatch.setattr(calibrator_mod, "driver", lambda: FakeCuda(fake))
    spec = BuildSpec(str(mlp), "int8", PROFILE, {"legacy_calibrator": True}, samples(tmp_path))
    extra = build_engine(spec, tmp_path / "e", print, {})
    assert extra["legacy_calibrator"] and extra["calibration_samples"] == 5
    assert [a.shape for a in fake.fed] == [(4, 16)] * 5  # the profile's opt shape
    assert len(named(fake, "set_calibration_profile")) == 1
    assert list((tmp_path / "timing").glob("calib-*.cache"))


def test_legacy_calibrator_fails_the_build_naming_a_bad_sample(
    fake_trt: Any, mlp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = fake_trt("8.6.1.6")
    monkeypatch.setattr(calibrator_mod, "driver", lambda: FakeCuda(fake))
    spec = BuildSpec(str(mlp), "int8", PROFILE, {"legacy_calibrator": True}, samples(tmp_path, bad=True))
    with pytest.raises(BuildError, match=r"calibration sample 02.npy: input 'x' has shape \[3, 16\]"):
        build_engine(spec, tmp_path / "e", print, {})
    assert len(fake.fed) == 2 and not (tmp_path / "e").exists()
    assert not list((tmp_path / "timing").glob("calib-*.cache"))  # no scales from part of the data


def test_dla_records_the_layers_left_to_the_gpu(fake_trt: Any, mlp: Path, tmp_path: Path) -> None:
    fake = fake_trt("10.3.0.30", dla_cores=2)
    static = {"x": ((4, 16), (4, 16), (4, 16))}
    extra = build_engine(BuildSpec(str(mlp), "fp16", static, {"dla_core": 1}), tmp_path / "e", print, {})
    assert extra["dla_gpu_fallback"] == {"layers": ["relu"], "count": 1, "of": 3}
    assert sorted(repr(f[0]) for f in named(fake, "set_flag")) == ["FP16", "GPU_FALLBACK"]
    with pytest.raises(BuildError, match="min = opt = max"):
        build_engine(BuildSpec(str(mlp), "fp16", PROFILE, {"dla_core": 1}), tmp_path / "e2", print, {})
    fake_trt("10.3.0.30", dla_cores=0)
    with pytest.raises(BuildError, match=r"this GPU has no DLA cores: set dla_core = -1"):
        build_engine(BuildSpec(str(mlp), "fp16", static, {"dla_core": 0}), tmp_path / "e3", print, {})


# --- one timing cache per device, for every build and every trial ---------------------------------

ORIN = {"tensorrt": "10.3.0.30", "gpu": "Orin", "l4t": "36.4.3"}


def test_builds_in_other_folders_share_the_devices_timing_cache(
    fake_trt: Any, mlp: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The second build (a search trial, its artefact in a temporary folder) loads what the
    first timed, from the engine cache's ``timing/``, and the log says so."""
    fake = fake_trt("10.3.0.30")
    cache = tmp_path / "cache"
    trial = tmp_path / "cache" / ".tmp-1-mixed-x"
    trial.mkdir(parents=True)
    spec = BuildSpec(str(mlp), "fp32", PROFILE, {}, cache_dir=str(cache))
    with caplog.at_level(logging.INFO, logger="edged.backends.tensorrt.timing"):
        first = build_engine(spec, cache / ".tmp-1-a.engine", print, ORIN)
        second = build_engine(spec, trial / "artefact.engine", print, ORIN)
    files = list((cache / "timing").iterdir())
    assert [f.name for f in files] == [first["timing_cache"]] == [second["timing_cache"]]
    assert [c[1] for c in named_calls(fake, "create_timing_cache")] == [b"", b"timings;"]
    assert first["timing_cache_bytes"] == [0, 8] and second["timing_cache_bytes"] == [8, 16]
    assert files[0].read_bytes() == b"timings;timings;"
    assert not (trial / "timing").exists()
    logged = [r.getMessage() for r in caplog.records]
    assert any("none yet for this device; this build times every tactic" in m for m in logged)
    assert any("0.0 KiB of tactic timings for this device loaded; layers timed before are not" in m for m in logged)


def named_calls(fake: FakeTensorRT, call: str) -> list[tuple[Any, ...]]:
    return [c for c in fake.calls if c[0] == call]


def test_a_timing_cache_tensorrt_rejects_is_quarantined_and_the_build_goes_on(
    fake_trt: Any, mlp: Path, tmp_path: Path
) -> None:
    fake_trt("10.3.0.30", reject_timing=b"garbage")
    cache = tmp_path / "cache"
    path = timing_cache_path("", cache, ORIN)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"garbage")
    extra = build_engine(BuildSpec(str(mlp), "fp32", PROFILE, {}, cache_dir=str(cache)), cache / "e", print, ORIN)
    assert extra["timing_cache_bytes"] == [0, 8] and path.read_bytes() == b"timings;"
    [moved] = [p for p in (cache / "quarantine").iterdir() if p.suffix != ".why"]
    assert moved.name.startswith(path.name) and moved.read_bytes() == b"garbage"
    assert "timing cache rejected by TensorRT" in Path(f"{moved}.why").read_text()


# --- the safer recipe, once -----------------------------------------------------------------------


@pytest.mark.parametrize("where", ["parse", "build"])
def test_a_strongly_typed_fp16_build_that_fails_is_retried_with_fp32_float_parts(
    fake_trt: Any, qdq: Path, tmp_path: Path, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    fake = fake_trt("10.3.0.30", fail_fp16=where)
    with caplog.at_level(logging.WARNING, logger="edged.backends.tensorrt.build"):
        extra = build_engine(BuildSpec(str(qdq), "int8", PROFILE, {}), tmp_path / "e", print, {})
    assert len(fake.parsed) == 2 and fake.parsed[1] == str(qdq)  # the Q/DQ model as quantized
    assert extra["float_parts"] == "fp32" and "fp16" not in extra
    why = "the FP16 Q/DQ scale is not supported" if where == "parse" else "Could not find any implementation"
    assert extra["retried"]["float_parts"] == "fp32" and why in extra["retried"]["because"]
    assert any("trying once more with the safer 'fp32'" in r.getMessage() for r in caplog.records)
    assert (tmp_path / "e").read_bytes() == b"engine"


def test_a_failed_fp16_conversion_is_retried_too(
    fake_trt: Any, qdq: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from edged.backends.tensorrt import build as build_mod

    def broken(*args: Any, **kwargs: Any) -> dict[str, Any]:
        raise BuildError("q.onnx: the FP16 conversion made an invalid model (...)")

    monkeypatch.setattr(build_mod, "to_mixed_fp16", broken)
    fake_trt("11.1.0")
    extra = build_engine(BuildSpec(str(qdq), "int8", PROFILE, {}), tmp_path / "e", print, {})
    assert extra["retried"]["because"].startswith("q.onnx: the FP16 conversion made an invalid model")


def test_when_the_safer_recipe_fails_too_both_reasons_are_given(fake_trt: Any, qdq: Path, tmp_path: Path) -> None:
    fake = fake_trt("10.3.0.30", fail_fp16="parse")
    original = fake.OnnxParser.parse_from_file

    def always_fails(self: Any, path: str) -> bool:
        original(self, path)
        self.num_errors = 1
        return False

    fake.OnnxParser.parse_from_file = always_fails
    with pytest.raises(BuildError) as failed:
        build_engine(BuildSpec(str(qdq), "int8", PROFILE, {}), tmp_path / "e", print, {})
    text = str(failed.value)
    assert text.startswith("TensorRT could not build mlp.qdq.onnx with float_parts = 'fp16' (TensorRT cannot parse")
    assert "nor with the safer 'fp32' (TensorRT cannot parse" in text
    assert len(fake.parsed) == 2


def test_a_recipe_without_fp16_float_parts_is_not_retried(fake_trt: Any, qdq: Path, tmp_path: Path) -> None:
    fake = fake_trt("8.6.1.6")  # weakly typed: the flags decide the float parts, nothing converts
    fake.Builder.build_serialized_network = lambda self, network, config: None
    with pytest.raises(BuildError, match="TensorRT could not build the engine"):
        build_engine(BuildSpec(str(qdq), "int8", PROFILE, {}), tmp_path / "e", print, {})
    assert len(fake.parsed) == 1


def test_the_dla_error_on_a_board_without_cores_names_that_board(
    fake_trt: Any, mlp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from edged.backends.tensorrt import build as build_mod

    monkeypatch.setattr(build_mod, "board_model", lambda: "NVIDIA Jetson Orin Nano Developer Kit (nvidia,p3767-0005)")
    fake_trt("10.3.0.30", dla_cores=0)
    static = {"x": ((4, 16), (4, 16), (4, 16))}
    with pytest.raises(BuildError) as failed:
        build_engine(BuildSpec(str(mlp), "fp16", static, {"dla_core": 0}), tmp_path / "e", print, {})
    assert str(failed.value) == (
        "tensorrt.dla_core = 0, but NVIDIA Jetson Orin Nano Developer Kit (nvidia,p3767-0005) has no DLA cores: "
        "set dla_core = -1 to run on the GPU"
    )
