"""``build_engine``'s wiring per TensorRT version, against ``FakeTensorRT``: a fake module for this
unit test of pure logic (it records calls; it builds nothing and knows none of TensorRT's
semantics beyond the calibrator's callback loop). What it checks: the flags, preview features and
profile copies each version's plan asks for reach the builder config; the model handed to the
parser; the legacy calibrator fed from the loader's samples with a bad one failing the build by
name; the layers DLA cannot run recorded. TensorRT's API names themselves are checked by the
strict mypy run against the official stubs (test_tensorrt_backend.py)."""

from __future__ import annotations

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

    def __init__(self, version: str, dla_cores: int = 0, layers: tuple[str, ...] = ("fc1", "relu", "fc2")) -> None:
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

        class Parser:
            num_errors = 0

            def __init__(self, network: Network, logger: Any) -> None:
                pass

            def parse_from_file(self, path: str) -> bool:
                fake.parsed.append(path)
                fake.parsed_model = onnx.load(path)
                return True

        class TimingCache:
            def serialize(self) -> bytes:
                return b"timing"

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
            def set_timing_cache(self, cache: Any, ignore: bool) -> bool:
                return True

            def create_timing_cache(self, data: bytes) -> TimingCache:
                return TimingCache()

            def get_timing_cache(self) -> TimingCache:
                return TimingCache()

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

            def build_serialized_network(self, network: Network, config: Config) -> bytes:
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
    with pytest.raises(BuildError, match=r"0 DLA core\(s\).*set dla_core = -1"):
        build_engine(BuildSpec(str(mlp), "fp16", static, {"dla_core": 0}), tmp_path / "e3", print, {})
