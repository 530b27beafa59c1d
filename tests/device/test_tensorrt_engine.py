"""The TensorRT backend end to end: build, load, run, compare, rebuild. Needs TensorRT (a Jetson,
or any NVIDIA GPU with TensorRT installed); skips, saying which, where the tensorrt module, a
TensorRT edged supports, pycuda, the CUDA driver or the GPU is absent (``missing_tensorrt``).
Past that, any exception, edged's own included, fails the test.

    pytest --noconftest -p no:cacheprovider tests/device
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from edged.backends.base import BuildSpec, LoadOptions, TensorSpec
from edged.backends.tensorrt import TensorRTBackend
from edged.backends.tensorrt.cuda import shared_device
from edged.backends.tensorrt.versions import parse_version, unsupported_reason
from edged.config import CalibrationConfig
from edged.errors import BuildError, CacheError, InvalidInputError
from edged.quantize.calibrate import CalibrationSet
from tests.device.test_tensorrt_cuda import missing_gpu

pytestmark = pytest.mark.device
PROFILES = {"x": ((1, 16), (4, 16), (8, 16))}
MiB = 1 << 20


def missing_tensorrt() -> str | None:
    """Why this machine has no TensorRT to test, or None. Found without edged's own availability
    check, so that a fault of edged's fails the test rather than skipping it."""
    spec = importlib.util.find_spec("tensorrt")
    if spec is None:
        return "tensorrt is not installed"
    if spec.origin is None:  # a namespace package: the tensorrt-stubs' .pyi files alone
        return "tensorrt is not installed (only its type stubs are)"
    import tensorrt

    too_old = unsupported_reason(parse_version(tensorrt.__version__))
    return too_old or missing_gpu()


@pytest.fixture(scope="module")
def major() -> int:
    why = missing_tensorrt()
    if why is not None:
        print(f"SKIP: {why}")
        pytest.skip(why)
    ok, why = TensorRTBackend.available()
    assert ok, f"TensorRT and a GPU are here, yet the backend says: {why}"
    return parse_version(TensorRTBackend.version())[0]


@pytest.fixture(scope="module")
def mlp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from edged.tools.demo import make_tiny_mlp

    return make_tiny_mlp(tmp_path_factory.mktemp("models") / "tiny.onnx")


def build(
    source: Path, dest: Path, precision: str, samples: CalibrationSet | None = None, **options: object
) -> dict[str, object]:
    phases: list[str] = []
    extra = TensorRTBackend.build(
        BuildSpec(str(source), precision, PROFILES, options, samples), dest, lambda phase, _: phases.append(phase)
    )
    assert phases[0] == "parsing" and "building" in phases
    return extra


def onnxruntime(source: Path, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"])
    return np.asarray(sess.run(None, {"x": x})[0])


def batches() -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.standard_normal((n, 16), dtype=np.float32) for n in (1, 3, 8)]


def test_fp32_engine_matches_onnxruntime(major: int, mlp: Path, tmp_path: Path) -> None:
    engine = tmp_path / "fp32.engine"
    extra = build(mlp, engine, "fp32")
    assert extra["strongly_typed"] == (major >= 10)
    assert (tmp_path / "timing" / str(extra["timing_cache"])).stat().st_size > 0
    backend = TensorRTBackend(engine)
    backend.load()
    assert [s.shape for s in backend.inputs] == [(-1, 16)]
    inst = backend.instance()
    for x in batches():
        np.testing.assert_allclose(
            inst.infer({"x": x})["probs"], onnxruntime(mlp, x), rtol=1e-2, atol=1e-3
        )  # TF32 may serve FP32 matmuls
    with pytest.raises(InvalidInputError, match="dim 0 is 9"):
        inst.infer({"x": np.zeros((9, 16), np.float32)})
    backend.unload()


def test_fp16_engine_or_the_reason_it_cannot_be_built(major: int, mlp: Path, tmp_path: Path) -> None:
    engine = tmp_path / "fp16.engine"
    if major >= 11:
        with pytest.raises(BuildError, match="AutoCast"):
            build(mlp, engine, "fp16")
        return
    assert build(mlp, engine, "fp16")["builder_flags"] == ["FP16"]
    backend = TensorRTBackend(engine)
    backend.load()
    x = batches()[2]
    np.testing.assert_allclose(backend.instance().infer({"x": x})["probs"], onnxruntime(mlp, x), atol=2e-2)
    backend.unload()


def test_int8_engine_from_the_qdq_model_passes_the_gate(major: int, mlp: Path, tmp_path: Path) -> None:
    from edged.tools.selftest import gate_metrics, selftest_qdq, synthetic_feeds

    specs = [("x", (4, 16), "float32")]
    qdq = selftest_qdq(mlp, tmp_path / "tiny.qdq.onnx", synthetic_feeds(specs, 32, seed=1))
    engine = tmp_path / "int8.engine"
    extra = build(qdq, engine, "int8")
    assert extra["builder_flags"] == ([] if major >= 10 else ["INT8", "FP16"])
    backend = TensorRTBackend(engine)
    backend.load()
    inst = backend.instance()
    feeds = synthetic_feeds(specs, 8, seed=2)
    got = [inst.infer(f) for f in feeds]
    ref = [{"probs": onnxruntime(mlp, f["x"])} for f in feeds]
    metrics = gate_metrics(ref, got)
    assert metrics["cosine"] >= 0.99 and metrics["top1"] >= 0.9, metrics
    backend.unload()


def calibration(tmp_path: Path, shape: tuple[int, ...] = (4, 16)) -> CalibrationSet:
    data = tmp_path / "calibration"
    data.mkdir(exist_ok=True)
    rng = np.random.default_rng(5)
    for i in range(16):
        np.save(data / f"{i:02}.npy", rng.standard_normal(shape, dtype=np.float32))
    return CalibrationSet.load(CalibrationConfig(data=str(data)), [TensorSpec("x", "float32", (-1, 16))])


def test_legacy_calibrator_up_to_10_and_refused_on_11(major: int, mlp: Path, tmp_path: Path) -> None:
    engine = tmp_path / "legacy.engine"
    samples = calibration(tmp_path)
    if major >= 11:
        with pytest.raises(BuildError, match="removed in TensorRT 11"):
            build(mlp, engine, "int8", samples, legacy_calibrator=True)
        return
    extra = build(mlp, engine, "int8", samples, legacy_calibrator=True)
    assert extra["legacy_calibrator"] is True and extra["calibration_samples"] == 16
    assert list((tmp_path / "timing").glob("calib-*.cache"))  # the calibration cache was kept
    backend = TensorRTBackend(engine)
    backend.load()
    x = batches()[1]
    probs = backend.instance().infer({"x": x})["probs"]
    assert np.allclose(probs.sum(axis=1), 1, atol=1e-2)
    backend.unload()


def test_legacy_calibrator_names_a_sample_off_the_calibration_shape(major: int, mlp: Path, tmp_path: Path) -> None:
    samples = calibration(tmp_path, shape=(3, 16))  # the profile's opt batch is 4
    # TensorRT 11 has no legacy calibrator: the build is refused before any sample is read.
    match = "removed in TensorRT 11" if major >= 11 else r"calibration sample 00.npy: input 'x' has shape \[3, 16\]"
    with pytest.raises(BuildError, match=match):
        build(mlp, tmp_path / "bad.engine", "int8", samples, legacy_calibrator=True)


@pytest.mark.parametrize("instances", [3])
def test_several_instances_of_a_dynamic_engine_serve_at_once(
    major: int, mlp: Path, tmp_path: Path, instances: int
) -> None:
    """Several instances of one engine: on 8.5 one profile per instance, on 8.6 profile sharing,
    on 10+ as is."""
    import threading

    engine = tmp_path / "multi.engine"
    extra = build(mlp, engine, "fp32", instances=TensorRTBackend.profiles_per_engine(instances))
    assert extra["profiles_per_input"] == TensorRTBackend.profiles_per_engine(instances)
    backend = TensorRTBackend(engine, LoadOptions(instances=instances))
    backend.load()
    insts = [backend.instance() for _ in range(instances)]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for x in batches():
                np.testing.assert_allclose(insts[i].infer({"x": x})["probs"], onnxruntime(mlp, x), rtol=1e-2, atol=1e-3)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(instances)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    backend.unload()
    assert errors == []


def test_a_bad_engine_is_a_cache_error_not_a_crash(major: int, mlp: Path, tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.engine"
    garbage.write_bytes(b"not an engine" * 100)
    with pytest.raises(CacheError, match="rebuild"):
        TensorRTBackend(garbage).load()
    good = tmp_path / "good.engine"
    build(mlp, good, "fp32")
    truncated = tmp_path / "truncated.engine"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(CacheError):
        TensorRTBackend(truncated).load()
    with pytest.raises(CacheError, match="cannot read"):
        TensorRTBackend(tmp_path / "missing.engine").load()


def test_unload_returns_the_memory(major: int, mlp: Path, tmp_path: Path) -> None:
    engine = tmp_path / "mem.engine"
    build(mlp, engine, "fp32")
    device = shared_device(0)
    free0, _ = device.mem_info()
    backend = TensorRTBackend(engine)
    backend.load()
    instances = [backend.instance() for _ in range(3)]
    for inst in instances:
        inst.infer({"x": batches()[0]})
    assert backend.footprint() > engine.stat().st_size
    backend.unload()
    assert free0 - device.mem_info()[0] < 64 * MiB


def test_fingerprint_names_everything_the_engine_is_bound_to(major: int) -> None:
    fp = TensorRTBackend.fingerprint()
    assert set(fp) == {
        "tensorrt",
        "tensorrt_cuda",
        "board",
        "gpu",
        "compute_capability",
        "sm_count",
        "driver",
        "cuda_driver",
        "l4t",
    }
    assert fp["tensorrt"] == TensorRTBackend.version()
    if shared_device(0).integrated:
        assert fp["l4t"], "a Jetson has /etc/nv_tegra_release"
