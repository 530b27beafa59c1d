"""The legacy implicit INT8 calibrator (entropy, with its calibration cache), TensorRT <= 10 only.

Explicit quantization (the Q/DQ model) is edged's INT8 path; this one exists for models whose Q/DQ
form loses accuracy on TensorRT 8/10, and because DLA on those versions takes its INT8 scales from a
calibrator. TensorRT 11 removed it; ``versions.plan_build`` refuses it there.

The samples are the build pipeline's calibration part (``edged.quantize.calibrate.CalibrationSet``,
the one loader every backend uses), read one file at a time: nothing holds the whole set. TensorRT
calibrates a dynamic-shape network at its calibration profile's ``opt`` shapes, so every sample is
checked against exactly those shapes (a file of several rows is split into rows when the shape's
batch is 1). TensorRT's binding turns an exception raised in ``get_batch`` into "no more data", so
the feeder keeps the first failure and ``build.py`` raises it, naming the sample, after the build.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edged.backends.tensorrt.cuda import driver
from edged.backends.tensorrt.shapes import Shape, narrow_int64
from edged.backends.tensorrt.versions import LEGACY_REFUSED, Version, has_weak_typing
from edged.cache.store import atomic_write
from edged.errors import BuildError

if TYPE_CHECKING:
    import tensorrt as trt

log = logging.getLogger(__name__)

Feed = dict[str, np.ndarray]
NamedFeed = tuple[str, Feed]
Upload = Callable[[str, np.ndarray], int]  # (input name, array) -> device address


class BatchFeeder:
    """The pure part of ``get_batch``: the next sample, checked against the calibration shapes
    (name -> (shape, numpy dtype)), handed to ``upload``; the first failure is kept in ``error``
    and ends the calibration."""

    def __init__(self, samples: Iterable[NamedFeed], shapes: Mapping[str, tuple[Shape, str]]) -> None:
        self._samples: Iterator[NamedFeed] = iter(samples)
        self._rows: list[NamedFeed] = []
        self.shapes = dict(shapes)
        self.error: BuildError | None = None
        self.fed = 0

    def _check(self, where: str, feed: Feed) -> list[Feed]:
        missing = sorted(set(self.shapes) - set(feed))
        if missing:
            raise BuildError(f"calibration sample {where}: no array for input(s) {', '.join(missing)}")
        rows: int | None = None
        feed = {name: self._typed(where, name, feed[name]) for name in self.shapes}
        for name, (shape, dtype) in self.shapes.items():
            arr = feed[name]
            if arr.dtype != np.dtype(dtype):
                raise BuildError(
                    f"calibration sample {where}: input '{name}' is {arr.dtype}, the network takes {dtype}"
                )
            if tuple(arr.shape) == shape:
                n = 1
            elif shape and shape[0] == 1 and tuple(arr.shape[1:]) == shape[1:] and arr.shape[0] > 1:
                n = int(arr.shape[0])  # several rows where the calibration shape takes one
            else:
                raise BuildError(
                    f"calibration sample {where}: input '{name}' has shape {list(arr.shape)}; TensorRT "
                    f"calibrates at {list(shape)} (the profile's opt shape for a dynamic input): give "
                    "samples of that shape or set the profile's opt to theirs"
                )
            if rows is not None and n != rows:
                raise BuildError(f"calibration sample {where}: inputs disagree on the number of rows")
            rows = n
        if rows is None or rows == 1:
            return [{name: np.ascontiguousarray(feed[name]) for name in self.shapes}]
        return [{name: np.ascontiguousarray(feed[name][i : i + 1]) for name in self.shapes} for i in range(rows)]

    def _typed(self, where: str, name: str, arr: np.ndarray) -> np.ndarray:
        """TensorRT 8.x's ONNX parser makes an INT64 input INT32, while the samples hold the ONNX
        model's INT64: narrowed (values INT32 cannot hold are refused, naming the sample)."""
        if arr.dtype != np.int64 or np.dtype(self.shapes[name][1]) != np.int32:
            return arr
        try:
            return narrow_int64(name, arr)
        except ValueError as e:
            raise BuildError(f"calibration sample {where}: {e}") from None

    def next_feed(self) -> NamedFeed | None:
        while not self._rows:
            item = next(self._samples, None)
            if item is None:
                return None
            where, feed = item
            self._rows = [(where, row) for row in self._check(where, feed)]
        return self._rows.pop(0)

    def get_batch(self, names: Sequence[str], upload: Upload) -> list[int]:
        """Device addresses of the next sample's inputs in ``names`` order, or [] at the end (or
        after a failure, which ``error`` holds)."""
        if self.error is not None:
            return []
        where = f"after {self.fed} sample(s)"
        try:
            item = self.next_feed()
            if item is None:
                return []
            where, feed = item
            unknown = sorted(set(names) - set(feed))
            if unknown:
                raise BuildError(f"TensorRT asks for input(s) {', '.join(unknown)} the samples do not have")
            addresses = [upload(name, feed[name]) for name in names]
        except Exception as e:  # TensorRT would read any exception as "no more data"
            text = str(e) if isinstance(e, BuildError) else f"{type(e).__name__}: {e}"
            self.error = BuildError(
                text if text.startswith("calibration sample") else f"calibration sample {where}: {text}"
            )
            return []
        self.fed += 1
        return addresses


def make_calibrator(feeder: BatchFeeder, cache_path: str, version: Version) -> trt.IInt8EntropyCalibrator2:
    """An entropy calibrator feeding ``feeder``'s samples from device buffers it owns, each sized
    for its input's calibration shape (freed with it; the build process ends right after); it
    reads and writes ``cache_path`` so a rebuild with the same data skips the calibration runs."""
    import tensorrt as trt

    if not has_weak_typing(version):  # TensorRT 11 has no IInt8EntropyCalibrator2
        raise BuildError(LEGACY_REFUSED.format(v=".".join(map(str, version))))

    class _Entropy(trt.IInt8EntropyCalibrator2):  # type: ignore[misc, unused-ignore]  # as in trtlog
        def __init__(self) -> None:
            trt.IInt8EntropyCalibrator2.__init__(self)
            self._device: dict[str, Any] = {}

        def get_batch_size(self) -> int:
            # Explicit-batch networks take the batch from the calibration shape itself.
            return 1

        def _upload(self, name: str, arr: np.ndarray) -> int:
            cuda = driver()
            if name not in self._device:
                shape, dtype = feeder.shapes[name]
                self._device[name] = cuda.mem_alloc(max(1, int(np.prod(shape)) * np.dtype(dtype).itemsize))
            cuda.memcpy_htod(self._device[name], arr)
            return int(self._device[name])

        def get_batch(self, names: list[str]) -> list[int]:
            return feeder.get_batch(names, self._upload)

        # None (no cache yet) makes TensorRT calibrate.
        def read_calibration_cache(self) -> bytes | None:
            try:
                with open(cache_path, "rb") as f:
                    log.info("using calibration cache %s", cache_path)
                    return f.read()
            except FileNotFoundError:
                return None

        def write_calibration_cache(self, cache: Any) -> None:
            if feeder.error is not None:  # scales from part of the data: the build fails, keep none
                log.warning("not keeping the calibration cache: %s", feeder.error)
                return
            os.makedirs(os.path.dirname(cache_path) or ".", exist_ok=True)
            atomic_write(Path(cache_path), bytes(cache))

    return _Entropy()
