"""Calibration data: a folder of samples turned into model feeds, its digest, and its split.

This is the one loader of calibration samples: ONNX Runtime's quantizer reads them through
:class:`FeedReader`, TensorRT's legacy calibrator through :meth:`CalibrationSet.named_feeds`, and
the engine cache key and the calibration caches use its one digest.

A ``[models.NAME.calibration]`` table names a folder holding either tensors (``.npy`` feeds a
single-input model, ``.npz`` maps input names to arrays) or images (decoded with Pillow and
preprocessed as the same table declares). One file is one unit: it is hashed, split and counted
as a whole, even when it holds a batch. Files are checked when the set is loaded, so a bad sample
fails the build in seconds with its name, not after minutes of calibration; the tensors themselves
are read again when iterated, because a few hundred camera frames do not fit a small board's RAM
twice over.

This module imports neither ONNX Runtime nor Pillow at import time: the daemon computes
:func:`data_digest` for the engine cache key on every boot.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edged.backends.base import TensorSpec
from edged.cache.store import file_digest
from edged.config import CalibrationConfig
from edged.errors import BuildError, ConfigError

log = logging.getLogger(__name__)

TENSOR_SUFFIXES = frozenset({".npy", ".npz"})
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp"})
Feed = dict[str, np.ndarray]
DigestFn = Callable[[str], str]


# --- the folder --------------------------------------------------------------------------------


def sample_files(folder: Path) -> tuple[str, list[Path]]:
    """("tensors" | "images", files sorted by relative name). Hidden files and other suffixes
    (a README, a labels file) are ignored; mixing tensors and images is an error."""
    if not folder.is_dir():
        raise ConfigError(f"calibration data {folder}: not a directory")
    tensors: list[Path] = []
    images: list[Path] = []
    for path in folder.rglob("*"):
        rel = path.relative_to(folder)
        if any(part.startswith(".") for part in rel.parts) or not path.is_file():
            continue
        suffix = path.suffix.lower()
        if suffix in TENSOR_SUFFIXES:
            tensors.append(path)
        elif suffix in IMAGE_SUFFIXES:
            images.append(path)
    if tensors and images:
        raise ConfigError(
            f"calibration data {folder}: holds both tensors ({tensors[0].name}) and images "
            f"({images[0].name}); use one kind per folder"
        )
    files = tensors or images
    if not files:
        raise ConfigError(
            f"calibration data {folder}: no samples (.npy/.npz tensors or {'/'.join(sorted(IMAGE_SUFFIXES))} images)"
        )
    files.sort(key=lambda p: p.relative_to(folder).as_posix())
    return ("tensors" if tensors else "images"), files


def _preprocessing(kind: str, cfg: CalibrationConfig) -> dict[str, Any]:
    """The parameters that change the tensors made from the files (and so the calibration)."""
    params: dict[str, Any] = {"kind": kind, "max_samples": cfg.max_samples}
    if kind == "images":
        params.update(
            resize=list(cfg.resize),
            layout=cfg.layout,
            color=cfg.color,
            scale=cfg.scale,
            mean=list(cfg.mean),
            std=list(cfg.std),
        )
    return params


def _digest(folder: Path, files: Sequence[Path], params: Mapping[str, Any], digest_file: DigestFn) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(params, sort_keys=True, separators=(",", ":")).encode())
    for path in files:
        h.update(b"\0" + path.relative_to(folder).as_posix().encode() + b"\0")
        h.update(digest_file(str(path)).encode())
    return h.hexdigest()


def data_digest(folder: str | Path, cfg: CalibrationConfig, digest_file: DigestFn = file_digest) -> str:
    """sha256 over the sorted relative names, each file's sha256 and the preprocessing
    parameters. ``digest_file`` may be ``SourceDigests.digest`` so a warm boot re-hashes
    nothing."""
    root = Path(folder)
    kind, files = sample_files(root)
    return _digest(root, files, _preprocessing(kind, cfg), digest_file)


def _rank(folder: Path, path: Path) -> str:
    # Files are ordered by a hash of their name, not the name itself, so that the held-out part
    # is a spread of the data rather than its alphabetical tail (frame_0900..frame_0999).
    return hashlib.sha256(path.relative_to(folder).as_posix().encode()).hexdigest()


# --- turning one file into feeds -----------------------------------------------------------------


def _fit(arr: np.ndarray, spec: TensorSpec, where: str) -> np.ndarray:
    """Give ``arr`` the input's dtype and a batch dimension, or say why it cannot have them."""
    want = len(spec.shape)
    if arr.ndim == want - 1:
        arr = arr[np.newaxis]  # a sample without its batch dimension
    elif arr.ndim != want:
        raise BuildError(
            f"{where}: input '{spec.name}' expects rank {want} {spec.describe()} "
            f"(or {want - 1} without the batch dimension), got shape {tuple(arr.shape)}"
        )
    if not all(d < 0 or d == got for d, got in zip(spec.shape[1:], arr.shape[1:])):
        raise BuildError(f"{where}: input '{spec.name}' expects {spec.describe()}, got shape {tuple(arr.shape)}")
    if arr.dtype != spec.np_dtype:
        if not np.can_cast(arr.dtype, spec.np_dtype, casting="same_kind"):
            raise BuildError(f"{where}: input '{spec.name}' is {spec.dtype}, the sample is {arr.dtype}")
        arr = arr.astype(spec.np_dtype)
    return np.ascontiguousarray(arr)


def _batches(feed: Feed, specs: Sequence[TensorSpec], where: str) -> list[Feed]:
    """One feed, or one per row when the model's batch dimension is fixed at 1 and the file
    holds several rows."""
    sizes = {arr.shape[0] for arr in feed.values()}
    if len(sizes) != 1:
        raise BuildError(f"{where}: inputs disagree on the batch size: {sorted(sizes)}")
    n = sizes.pop()
    fixed = {s.shape[0] for s in specs if s.shape and s.shape[0] > 0}
    if not fixed or fixed == {n}:
        return [feed]
    if fixed == {1}:
        return [{k: v[i : i + 1] for k, v in feed.items()} for i in range(n)]
    raise BuildError(f"{where}: the model takes a batch of {sorted(fixed)}, the sample has {n}")


def _load_tensors(path: Path, specs: Sequence[TensorSpec], where: str) -> Feed:
    try:
        if path.suffix.lower() == ".npy":
            if len(specs) != 1:
                names = ", ".join(s.name for s in specs)
                raise BuildError(
                    f"{where}: an .npy file feeds a single-input model; this model has inputs "
                    f"[{names}]: save each sample as .npz with one array per input name"
                )
            return {specs[0].name: _fit(np.load(path, allow_pickle=False), specs[0], where)}
        with np.load(path, allow_pickle=False) as npz:
            raw = {k: npz[k] for k in npz.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise BuildError(f"{where}: cannot read: {e}") from None
    want = {s.name for s in specs}
    if set(raw) != want:
        missing, extra = sorted(want - set(raw)), sorted(set(raw) - want)
        raise BuildError(
            f"{where}: arrays must be named after the model's inputs [{', '.join(sorted(want))}]"
            f"; missing {missing}, unexpected {extra}"
        )
    return {s.name: _fit(raw[s.name], s, where) for s in specs}


@dataclass(frozen=True)
class ImageGeometry:
    """Where channels, height and width sit in the model's 4-D image input."""

    channels: int
    size: tuple[int, int] | None  # (H, W) to resize to; None keeps each image's own size
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @classmethod
    def of(cls, spec: TensorSpec, cfg: CalibrationConfig, source: str) -> ImageGeometry:
        if len(spec.shape) != 4:
            raise ConfigError(f"{source}: images feed a 4-D input; '{spec.name}' is {spec.describe()}")
        c, h, w = spec.shape[1:] if cfg.layout == "NCHW" else (spec.shape[3], spec.shape[1], spec.shape[2])
        channels = c if c > 0 else 3
        if channels not in (1, 3):
            raise ConfigError(f"{source}: images give 1 or 3 channels, '{spec.name}' has {c}")
        norm = {"mean": tuple(cfg.mean), "std": tuple(cfg.std)}
        for key, values in norm.items():
            if len(set(values)) == 1:
                norm[key] = values[:1]  # the same for every channel: fits any channel count
            elif len(values) != channels:
                raise ConfigError(f"{source}: {key} has {len(values)} values, the input has {channels} channels")
        if 0.0 in norm["std"]:
            raise ConfigError(f"{source}: std must not be 0")
        if cfg.resize:
            if len(cfg.resize) != 2:
                raise ConfigError(f"{source}: resize is [height, width], got {list(cfg.resize)}")
            size: tuple[int, int] | None = (cfg.resize[0], cfg.resize[1])
            if (h > 0 and h != cfg.resize[0]) or (w > 0 and w != cfg.resize[1]):
                raise ConfigError(
                    f"{source}: resize {list(cfg.resize)} does not fit input "
                    f"'{spec.name}' {spec.describe()} ({cfg.layout})"
                )
        else:
            size = (h, w) if h > 0 and w > 0 else None
        return cls(channels, size, norm["mean"], norm["std"])


def _load_image(path: Path, spec: TensorSpec, geo: ImageGeometry, cfg: CalibrationConfig, where: str) -> Feed:
    from PIL import Image, UnidentifiedImageError  # only image calibration needs Pillow

    try:
        with Image.open(path) as img:
            img = img.convert("L" if geo.channels == 1 else "RGB")
            if geo.size is not None and (img.height, img.width) != geo.size:
                img = img.resize((geo.size[1], geo.size[0]), Image.Resampling.BILINEAR)
            pixels = np.asarray(img, dtype=np.float32)
    except (OSError, UnidentifiedImageError) as e:
        raise BuildError(f"{where}: cannot decode image: {e}") from None
    if pixels.ndim == 2:
        pixels = pixels[:, :, np.newaxis]
    if cfg.color == "BGR":
        pixels = pixels[:, :, ::-1]
    mean = np.asarray(geo.mean, dtype=np.float32)
    std = np.asarray(geo.std, dtype=np.float32)
    arr = (pixels * np.float32(cfg.scale) - mean) / std
    if cfg.layout == "NCHW":
        arr = arr.transpose(2, 0, 1)
    if np.issubdtype(spec.np_dtype, np.integer):
        info = np.iinfo(spec.np_dtype)
        arr = np.clip(np.rint(arr), info.min, info.max)
    return {spec.name: _fit(arr.astype(spec.np_dtype), spec, where)}


# --- the set -----------------------------------------------------------------------------------


class CalibrationSet:
    """An ordered set of sample files for one model, read lazily as feeds."""

    def __init__(
        self,
        folder: Path,
        files: Sequence[Path],
        kind: str,
        inputs: Sequence[TensorSpec],
        cfg: CalibrationConfig,
        digest: str,
    ) -> None:
        self.folder = folder
        self.files = tuple(files)
        self.kind = kind
        self.inputs = tuple(inputs)
        self.cfg = cfg
        self.digest = digest
        self._geometry = ImageGeometry.of(self.inputs[0], cfg, str(folder)) if kind == "images" else None

    @classmethod
    def load(
        cls, cfg: CalibrationConfig, inputs: Sequence[TensorSpec], digest_file: DigestFn = file_digest
    ) -> CalibrationSet:
        """Select up to ``cfg.max_samples`` files of ``cfg.data`` and check every one against
        the model's inputs. ``digest`` covers the whole folder (as :func:`data_digest`)."""
        folder = Path(cfg.data)
        kind, files = sample_files(folder)
        if kind == "images" and len(inputs) != 1:
            names = ", ".join(s.name for s in inputs)
            raise ConfigError(
                f"calibration data {folder}: images feed a single-input model; this model has "
                f"inputs [{names}]: use .npz samples"
            )
        digest = _digest(folder, files, _preprocessing(kind, cfg), digest_file)
        if len(files) > cfg.max_samples:
            log.info("calibration data %s: using %d of %d files (max_samples)", folder, cfg.max_samples, len(files))
            chosen = sorted(files, key=lambda p: _rank(folder, p))[: cfg.max_samples]
            files = sorted(chosen, key=lambda p: p.relative_to(folder).as_posix())
        self = cls(folder, files, kind, inputs, cfg, digest)
        for path in self.files:
            self.feeds_of(path)  # fail now, with the file's name, not during calibration
        return self

    def __len__(self) -> int:
        return len(self.files)

    def __iter__(self) -> Iterator[Feed]:
        for path in self.files:
            yield from self.feeds_of(path)

    def named_feeds(self) -> Iterator[tuple[str, Feed]]:
        """(file name relative to the folder, feed), one file read at a time: what a backend that
        calibrates itself (TensorRT's legacy calibrator) iterates, so an error names the file."""
        for path in self.files:
            name = path.relative_to(self.folder).as_posix()
            for feed in self.feeds_of(path):
                yield name, feed

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.relative_to(self.folder).as_posix() for p in self.files)

    def feeds_of(self, path: Path) -> list[Feed]:
        where = f"calibration sample {path}"
        if self._geometry is not None:
            feed = _load_image(path, self.inputs[0], self._geometry, self.cfg, where)
        else:
            feed = _load_tensors(path, self.inputs, where)
        return _batches(feed, self.inputs, where)

    def subset(self, files: Sequence[Path], tag: str) -> CalibrationSet:
        rel = "\0".join(p.relative_to(self.folder).as_posix() for p in files)
        digest = hashlib.sha256(f"{self.digest}:{tag}:{rel}".encode()).hexdigest()
        return CalibrationSet(self.folder, files, self.kind, self.inputs, self.cfg, digest)

    def split(self, holdout: float) -> tuple[CalibrationSet, CalibrationSet]:
        """(calibration part, held-out part), the same on every run: files are ranked by a hash
        of their name and the first ``ceil(n * holdout)`` are held out (at least one each)."""
        if len(self.files) < 2:
            raise BuildError(
                f"calibration data {self.folder}: {len(self.files)} sample; at least 2 are "
                "needed to calibrate on some and check accuracy on others"
            )
        n_hold = min(len(self.files) - 1, max(1, math.ceil(len(self.files) * holdout)))
        ranked = sorted(self.files, key=lambda p: _rank(self.folder, p))
        held = set(ranked[:n_hold])
        calib = [p for p in self.files if p not in held]
        return (
            self.subset(calib, f"calibrate:{holdout}"),
            self.subset([p for p in self.files if p in held], f"holdout:{holdout}"),
        )

    def reader(self) -> FeedReader:
        return FeedReader(self)


class FeedReader:
    """ONNX Runtime's ``CalibrationDataReader`` protocol over a :class:`CalibrationSet`.

    ORT's reader base class recognises any class with ``get_next`` (``__subclasshook__``), so
    this module need not import ONNX Runtime. ``set_range`` selects files, which is how the
    quantizer feeds the calibrator in chunks to bound its memory."""

    def __init__(self, samples: CalibrationSet) -> None:
        self.samples = samples
        self._start, self._end = 0, len(samples)
        self._it: Iterator[Feed] | None = None

    def _iterate(self) -> Iterator[Feed]:
        for path in self.samples.files[self._start : self._end]:
            yield from self.samples.feeds_of(path)

    def get_next(self) -> Feed | None:
        if self._it is None:
            self._it = self._iterate()
        return next(self._it, None)

    def __iter__(self) -> Iterator[Feed]:
        return self._iterate()

    def __len__(self) -> int:
        return self._end - self._start

    def set_range(self, start_index: int, end_index: int) -> None:
        self._start, self._end = max(0, start_index), min(len(self.samples), end_index)
        self._it = None

    def rewind(self) -> None:
        self._it = None
