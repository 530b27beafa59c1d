"""Calibration data: loading .npy/.npz/images into feeds, the digest, the split, the ORT reader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from edged.backends.base import TensorSpec
from edged.config import CalibrationConfig
from edged.errors import BuildError, ConfigError
from edged.quantize.calibrate import CalibrationSet, FeedReader, data_digest

IMG = TensorSpec("x", "float32", (-1, 3, 4, 6))


def cfg(folder: Path, **kw: Any) -> CalibrationConfig:
    return CalibrationConfig(data=str(folder), **kw)


def npy_folder(folder: Path, n: int, shape: tuple[int, ...] = (3, 4, 6), dtype: Any = np.float32) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        np.save(folder / f"s{i:03d}.npy", np.full(shape, i, dtype=dtype))
    return folder


# --- tensors ----------------------------------------------------------------------------------


def test_npy_with_and_without_batch_dim_become_batched_feeds(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.ones((3, 4, 6), np.float64))  # no batch dim, float64
    np.save(tmp_path / "b.npy", np.full((2, 3, 4, 6), 2.0, np.float32))  # a batch of two
    (tmp_path / "README.txt").write_text("ignored")
    cs = CalibrationSet.load(cfg(tmp_path), [IMG])
    feeds = list(cs)
    assert cs.names == ("a.npy", "b.npy")
    assert [f["x"].shape for f in feeds] == [(1, 3, 4, 6), (2, 3, 4, 6)]
    assert all(f["x"].dtype == np.float32 for f in feeds)
    assert feeds[1]["x"][1, 0, 0, 0] == 2.0


def test_fixed_batch_of_one_splits_a_file_into_rows(tmp_path: Path) -> None:
    np.save(tmp_path / "rows.npy", np.arange(3 * 5, dtype=np.float32).reshape(3, 5))
    cs = CalibrationSet.load(cfg(tmp_path), [TensorSpec("x", "float32", (1, 5))])
    feeds = list(cs)
    assert len(cs) == 1 and len(feeds) == 3
    assert [int(f["x"][0, 0]) for f in feeds] == [0, 5, 10]


def test_npz_maps_input_names(tmp_path: Path) -> None:
    specs = [TensorSpec("a", "float32", (-1, 2)), TensorSpec("b", "int64", (-1, 2))]
    np.savez(tmp_path / "one.npz", a=np.zeros((1, 2), np.float32), b=np.array([3, 4]))
    feed = next(iter(CalibrationSet.load(cfg(tmp_path), specs)))
    assert feed["a"].shape == (1, 2) and feed["b"].shape == (1, 2)
    assert feed["b"].dtype == np.int64 and feed["b"].tolist() == [[3, 4]]
    np.savez(tmp_path / "two.npz", a=np.zeros((2, 2), np.float32), b=np.zeros((3, 2), np.int64))
    with pytest.raises(BuildError, match=r"two\.npz: inputs disagree on the batch size: \[2, 3\]"):
        CalibrationSet.load(cfg(tmp_path), specs)


def test_npz_with_wrong_names_is_refused(tmp_path: Path) -> None:
    specs = [TensorSpec("a", "float32", (-1, 2)), TensorSpec("b", "float32", (-1, 2))]
    np.savez(tmp_path / "bad.npz", a=np.zeros((1, 2), np.float32), c=np.zeros((1, 2)))
    with pytest.raises(BuildError, match=r"bad\.npz.*missing \['b'\], unexpected \['c'\]"):
        CalibrationSet.load(cfg(tmp_path), specs)


def test_npy_for_a_multi_input_model_is_refused(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.zeros((1, 2), np.float32))
    specs = [TensorSpec("a", "float32", (-1, 2)), TensorSpec("b", "float32", (-1, 2))]
    with pytest.raises(BuildError, match=r"single-input model.*\[a, b\].*\.npz"):
        CalibrationSet.load(cfg(tmp_path), specs)


@pytest.mark.parametrize(
    ("shape", "dtype", "message"),
    [
        ((3, 5, 6), np.float32, r"expects float32\[\?,3,4,6\], got shape \(1, 3, 5, 6\)"),
        ((4, 6), np.float32, r"expects rank 4"),
        ((3, 4, 6), np.complex64, r"is float32, the sample is complex64"),
    ],
)
def test_mismatched_samples_name_the_file_and_the_expectation(
    tmp_path: Path, shape: tuple[int, ...], dtype: Any, message: str
) -> None:
    npy_folder(tmp_path / "d", 1)
    np.save(tmp_path / "d" / "zz_bad.npy", np.zeros(shape, dtype))
    with pytest.raises(BuildError, match=rf"zz_bad\.npy.*{message}"):
        CalibrationSet.load(cfg(tmp_path / "d"), [IMG])


@pytest.mark.parametrize(("name", "data"), [("junk.npy", b"not numpy"), ("cut.npz", b"PK\x03\x04truncated")])
def test_unreadable_files_name_the_file(tmp_path: Path, name: str, data: bytes) -> None:
    (tmp_path / name).write_bytes(data)
    with pytest.raises(BuildError, match=rf"{name}: cannot read"):
        CalibrationSet.load(cfg(tmp_path), [IMG])


def test_float_data_for_an_integer_input_is_refused(tmp_path: Path) -> None:
    np.save(tmp_path / "ids.npy", np.zeros((1, 4), np.float32))
    with pytest.raises(BuildError, match="is int64, the sample is float32"):
        CalibrationSet.load(cfg(tmp_path), [TensorSpec("ids", "int64", (-1, 4))])


def test_empty_missing_and_mixed_folders_are_config_errors(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / ".hidden.npy").write_bytes(b"")
    with pytest.raises(ConfigError, match="no samples"):
        CalibrationSet.load(cfg(tmp_path / "empty"), [IMG])
    with pytest.raises(ConfigError, match="not a directory"):
        data_digest(tmp_path / "nope", cfg(tmp_path / "nope"))
    mixed = npy_folder(tmp_path / "mixed", 1)
    Image.new("RGB", (6, 4)).save(mixed / "a.png")
    with pytest.raises(ConfigError, match="both tensors .* and images"):
        CalibrationSet.load(cfg(mixed), [IMG])


# --- images -----------------------------------------------------------------------------------


def test_images_are_resized_reordered_and_normalized(tmp_path: Path) -> None:
    Image.new("RGB", (12, 8), (10, 20, 30)).save(tmp_path / "solid.png")
    c = cfg(tmp_path, resize=[4, 6], color="BGR", scale=1 / 255, mean=[0.5] * 3, std=[0.25] * 3)
    x = next(iter(CalibrationSet.load(c, [IMG])))["x"]
    assert x.shape == (1, 3, 4, 6) and x.dtype == np.float32
    want = [(v / 255 - 0.5) / 0.25 for v in (30, 20, 10)]  # BGR: blue first
    np.testing.assert_allclose(x[0, :, 0, 0], want, rtol=1e-5)
    np.testing.assert_allclose(x[0, :, 3, 5], want, rtol=1e-5)


def test_nhwc_gray_and_native_size(tmp_path: Path) -> None:
    Image.new("L", (5, 7), 51).save(tmp_path / "g.png")
    spec = TensorSpec("img", "float32", (-1, -1, -1, 1))  # NHWC, dynamic H and W, one channel
    x = next(iter(CalibrationSet.load(cfg(tmp_path, layout="NHWC", mean=[0.0]), [spec])))["img"]
    assert x.shape == (1, 7, 5, 1)
    np.testing.assert_allclose(x, 0.2, rtol=1e-6)


def test_image_settings_that_cannot_fit_the_input_are_config_errors(tmp_path: Path) -> None:
    Image.new("RGB", (6, 4)).save(tmp_path / "a.png")
    with pytest.raises(ConfigError, match=r"resize \[8, 8\] does not fit"):
        CalibrationSet.load(cfg(tmp_path, resize=[8, 8]), [IMG])
    with pytest.raises(ConfigError, match="mean has 2 values, the input has 3 channels"):
        CalibrationSet.load(cfg(tmp_path, mean=[0.1, 0.2]), [IMG])
    with pytest.raises(ConfigError, match="images feed a single-input model"):
        CalibrationSet.load(cfg(tmp_path), [IMG, TensorSpec("y", "float32", (1,))])


def test_undecodable_image_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "broken.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(BuildError, match=r"broken\.jpg: cannot decode image"):
        CalibrationSet.load(cfg(tmp_path), [IMG])


# --- digest and split --------------------------------------------------------------------------


def test_data_digest_covers_names_contents_and_preprocessing(tmp_path: Path) -> None:
    d = npy_folder(tmp_path / "d", 3)
    base = data_digest(d, cfg(d))
    assert base == data_digest(d, cfg(d)) == CalibrationSet.load(cfg(d), [IMG]).digest
    (d / ".cache").mkdir()
    (d / ".cache" / "x.npy").write_bytes(b"hidden files are not samples")
    (d / "notes.md").write_text("neither are other files")
    assert data_digest(d, cfg(d)) == base
    assert data_digest(d, cfg(d, mean=[0.1, 0.1, 0.1])) == base  # tensors: image params unused
    assert data_digest(d, cfg(d, max_samples=2)) != base
    np.save(d / "s001.npy", np.full((3, 4, 6), 9, np.float32))
    changed = data_digest(d, cfg(d))
    assert changed != base
    (d / "s001.npy").rename(d / "s999.npy")
    assert data_digest(d, cfg(d)) not in (base, changed)
    seen: list[str] = []

    def remember(path: str) -> str:
        seen.append(path)
        return "x"

    data_digest(d, cfg(d), digest_file=remember)
    assert sorted(Path(p).name for p in seen) == ["s000.npy", "s002.npy", "s999.npy"]


def test_image_preprocessing_is_part_of_the_digest(tmp_path: Path) -> None:
    Image.new("RGB", (6, 4)).save(tmp_path / "a.png")
    digests = {
        data_digest(tmp_path, cfg(tmp_path, **kw))
        for kw in (
            {},
            {"color": "BGR"},
            {"layout": "NHWC"},
            {"resize": [4, 6]},
            {"scale": 1.0},
            {"mean": [0.5, 0.5, 0.5]},
            {"std": [0.2, 0.2, 0.2]},
        )
    }
    assert len(digests) == 7


def test_split_is_deterministic_disjoint_and_never_empty(tmp_path: Path) -> None:
    d = npy_folder(tmp_path / "d", 10)
    cs = CalibrationSet.load(cfg(d), [IMG])
    calib, held = cs.split(0.2)
    again = CalibrationSet.load(cfg(d), [IMG]).split(0.2)
    assert (calib.names, held.names) == (again[0].names, again[1].names)
    assert len(held) == 2 and len(calib) == 8
    assert set(calib.names).isdisjoint(held.names)
    assert sorted(calib.names + held.names) == sorted(cs.names)
    assert held.names != ("s008.npy", "s009.npy")  # a spread, not the alphabetical tail
    assert len({cs.digest, calib.digest, held.digest}) == 3
    assert [len(p) for p in CalibrationSet.load(cfg(npy_folder(tmp_path / "two", 2)), [IMG]).split(0.01)] == [1, 1]
    with pytest.raises(BuildError, match="at least 2"):
        CalibrationSet.load(cfg(npy_folder(tmp_path / "one", 1)), [IMG]).split(0.2)


def test_max_samples_keeps_a_deterministic_subset(tmp_path: Path) -> None:
    d = npy_folder(tmp_path / "d", 12)
    a = CalibrationSet.load(cfg(d, max_samples=5), [IMG])
    b = CalibrationSet.load(cfg(d, max_samples=5), [IMG])
    assert len(a) == 5 and a.names == b.names
    assert a.names != tuple(f"s{i:03d}.npy" for i in range(5))


def test_reader_speaks_ort_calibration_protocol(tmp_path: Path) -> None:
    from onnxruntime.quantization import CalibrationDataReader

    cs = CalibrationSet.load(cfg(npy_folder(tmp_path / "d", 5)), [IMG])
    reader = cs.reader()
    assert isinstance(reader, CalibrationDataReader) and isinstance(reader, FeedReader)
    values = []
    while (feed := reader.get_next()) is not None:
        values.append(int(feed["x"][0, 0, 0, 0]))
    assert values == [0, 1, 2, 3, 4]
    reader.set_range(1, 3)
    assert len(reader) == 2
    assert [int(f["x"][0, 0, 0, 0]) for f in iter(reader.get_next, None)] == [1, 2]
    reader.rewind()
    assert int(reader.get_next()["x"][0, 0, 0, 0]) == 1  # type: ignore[index]
