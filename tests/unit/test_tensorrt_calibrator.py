"""TensorRT's legacy calibrator without TensorRT: the sample feeder ``get_batch`` runs (one loader,
checked against the calibration shapes, streamed, failures kept and named), and the build
pipeline handing the legacy path the FP32 model and the calibration part of the samples."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from edged.backends.base import BuildSpec, Progress, TensorSpec
from edged.backends.onnxruntime import OnnxRuntimeBackend
from edged.backends.tensorrt.build import calibration_digest
from edged.backends.tensorrt.calibrator import BatchFeeder, NamedFeed
from edged.cache.store import EngineCache, file_digest
from edged.config import CalibrationConfig
from edged.errors import BuildError
from edged.quantize.calibrate import CalibrationSet
from edged.quantize.job import BuildJob
from edged.quantize.pipeline import build_precision

X = TensorSpec("x", "float32", (-1, 16))


def feeds(n: int, shape: tuple[int, ...] = (2, 16)) -> list[NamedFeed]:
    return [(f"s{i}.npy", {"x": np.full(shape, i, np.float32)}) for i in range(n)]


def upload_into(store: list[np.ndarray]) -> Any:
    def upload(name: str, arr: np.ndarray) -> int:
        store.append(arr.copy())
        return 1000 + len(store)

    return upload


def test_feeds_each_sample_at_the_calibration_shape_then_ends() -> None:
    got: list[np.ndarray] = []
    feeder = BatchFeeder(feeds(3), {"x": ((2, 16), "float32")})
    addresses = [feeder.get_batch(["x"], upload_into(got)) for _ in range(4)]
    assert addresses == [[1001], [1002], [1003], []]
    assert [int(a[0, 0]) for a in got] == [0, 1, 2] and feeder.fed == 3 and feeder.error is None


def test_rows_are_split_when_calibration_takes_a_batch_of_one() -> None:
    got: list[np.ndarray] = []
    rows = [("rows.npy", {"x": np.arange(48, dtype=np.float32).reshape(3, 16)})]
    feeder = BatchFeeder(rows, {"x": ((1, 16), "float32")})
    while feeder.get_batch(["x"], upload_into(got)):
        pass
    assert [a.shape for a in got] == [(1, 16)] * 3 and [int(a[0, 0]) for a in got] == [0, 16, 32]


@pytest.mark.parametrize(
    "sample, match",
    [
        ({"x": np.zeros((3, 16), np.float32)}, r"bad.npy: input 'x' has shape \[3, 16\]; TensorRT calibrates at \[2, "),
        ({"x": np.zeros((2, 8), np.float32)}, r"bad.npy: input 'x' has shape \[2, 8\]"),
        ({"x": np.zeros((2, 16), np.float64)}, r"bad.npy: input 'x' is float64, the network takes float32"),
        ({"y": np.zeros((2, 16), np.float32)}, r"bad.npy: no array for input\(s\) x"),
    ],
)
def test_a_sample_off_the_calibration_shape_is_a_build_error_naming_it(
    sample: dict[str, np.ndarray], match: str
) -> None:
    got: list[np.ndarray] = []
    feeder = BatchFeeder([*feeds(1), ("bad.npy", sample), *feeds(2)], {"x": ((2, 16), "float32")})
    assert feeder.get_batch(["x"], upload_into(got)) == [1001]
    assert feeder.get_batch(["x"], upload_into(got)) == []  # TensorRT reads: no more data
    assert feeder.error is not None and feeder.fed == 1
    with pytest.raises(BuildError, match=match):
        raise feeder.error
    assert feeder.get_batch(["x"], upload_into(got)) == []  # and stays ended
    assert len(got) == 1


def test_int64_samples_feed_the_int32_input_tensorrt_8_makes_of_them() -> None:
    """TensorRT 8.x's ONNX parser turns an INT64 input into INT32; the samples hold the ONNX
    model's INT64 (the same files ONNX Runtime's quantizer reads): narrowed, range-checked."""
    got: list[np.ndarray] = []
    ids = ("ids.npy", {"ids": np.arange(8, dtype=np.int64).reshape(2, 4)})
    feeder = BatchFeeder([ids], {"ids": ((1, 4), "int32")})
    while feeder.get_batch(["ids"], upload_into(got)):
        pass
    assert feeder.error is None and [a.dtype for a in got] == [np.int32, np.int32]
    assert [a.tolist() for a in got] == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    huge = ("huge.npy", {"ids": np.full((1, 4), 2**40, np.int64)})
    feeder = BatchFeeder([huge], {"ids": ((1, 4), "int32")})
    assert feeder.get_batch(["ids"], upload_into(got)) == []
    assert str(feeder.error).startswith("calibration sample huge.npy: input 'ids' holds values outside int32")


def test_an_exception_inside_get_batch_is_kept_with_the_sample_name() -> None:
    def failing_upload(name: str, arr: np.ndarray) -> int:
        raise MemoryError("cuMemAlloc failed")

    feeder = BatchFeeder(feeds(2), {"x": ((2, 16), "float32")})
    assert feeder.get_batch(["x"], failing_upload) == []
    assert feeder.error is not None
    assert str(feeder.error) == "calibration sample s0.npy: MemoryError: cuMemAlloc failed"


def test_samples_are_pulled_one_at_a_time() -> None:
    pulled: list[int] = []

    def lazy() -> Iterator[NamedFeed]:
        for i, item in enumerate(feeds(50)):
            pulled.append(i)
            yield item

    feeder = BatchFeeder(lazy(), {"x": ((2, 16), "float32")})
    feeder.get_batch(["x"], upload_into([]))
    feeder.get_batch(["x"], upload_into([]))
    assert pulled == [0, 1]


def test_the_one_loader_streams_files_and_names_them(tmp_path: Path) -> None:
    for i in range(3):
        np.save(tmp_path / f"s{i}.npy", np.full((2, 16), i, np.float32))
    samples = CalibrationSet.load(CalibrationConfig(data=str(tmp_path)), [X])
    it = samples.named_feeds()
    name, feed = next(it)
    assert name == "s0.npy" and feed["x"].shape == (2, 16)
    (tmp_path / "s1.npy").write_bytes(b"not numpy")  # read only now: nothing was held
    with pytest.raises(BuildError, match="s1.npy"):
        next(it)


def test_calibration_cache_names_follow_the_loader_digest(tmp_path: Path) -> None:
    model = tmp_path / "m.onnx"
    model.write_bytes(b"model")
    a = calibration_digest(str(model), "digest-a")
    assert a == calibration_digest(str(model), "digest-a")
    assert a != calibration_digest(str(model), "digest-b")
    model.write_bytes(b"other model")
    assert a != calibration_digest(str(model), "digest-a")


# --- the pipeline's legacy path, with a stand-in backend ------------------------------------------


class FakeLegacyBackend(OnnxRuntimeBackend):
    """A fake for this unit test of the pipeline's logic: records the BuildSpec the TensorRT
    backend would get, runs the legacy feeder over the samples it was handed, and builds with
    ONNX Runtime so the pipeline's accuracy gate runs for real."""

    name = "fake-legacy"
    seen: ClassVar[list[BuildSpec]] = []
    fed: ClassVar[list[int]] = []

    @classmethod
    def build(cls, spec: BuildSpec, dest: Path, progress: Progress) -> dict[str, Any]:
        cls.seen.append(spec)
        if spec.calibration is not None:
            feeder = BatchFeeder(spec.calibration.named_feeds(), {"x": ((4, 16), "float32")})
            while feeder.get_batch(["x"], lambda name, arr: 1):
                pass
            if feeder.error is not None:
                raise feeder.error
            cls.fed.append(feeder.fed)
        return super().build(spec, dest, progress)


def job(tmp_path: Path, mlp: Path, data: Path, options: Mapping[str, Any]) -> BuildJob:
    return BuildJob(
        model="mlp",
        source=str(mlp),
        precision="int8",
        backend=FakeLegacyBackend.name,
        cache_dir=str(tmp_path / "cache"),
        source_digest=file_digest(mlp),
        options=dict(options),
        calibration={"data": str(data), "max_samples": 256},
        calibration_digest="d",
        gate={"holdout": 0.2},
    )


@pytest.mark.parametrize("legacy", [True, False], ids=["legacy-calibrator", "qdq"])
def test_the_legacy_calibrator_gets_the_fp32_model_and_the_calibration_part(tmp_path: Path, legacy: bool) -> None:
    from edged.tools.demo import make_tiny_mlp

    mlp = make_tiny_mlp(tmp_path / "mlp.onnx")
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for i in range(10):
        np.save(data / f"{i:02}.npy", rng.standard_normal((4, 16), dtype=np.float32))
    cache = EngineCache(tmp_path / "cache")
    cache.prepare()
    FakeLegacyBackend.seen.clear()
    FakeLegacyBackend.fed.clear()
    entry = build_precision(job(tmp_path, mlp, data, {"legacy_calibrator": legacy}), FakeLegacyBackend, cache, print)
    spec = FakeLegacyBackend.seen[0]
    if legacy:
        assert spec.source == str(mlp)  # the FP32 model, not a Q/DQ one
        assert len(spec.calibration) == 8  # 10 files, 2 held out for the gate
        assert FakeLegacyBackend.fed == [8]
        assert entry.manifest["gate"]["passed"]
    else:
        assert spec.source != str(mlp) and spec.source.endswith(".onnx") and spec.calibration is None
