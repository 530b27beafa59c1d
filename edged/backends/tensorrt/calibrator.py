"""The legacy implicit INT8 calibrator (entropy, with its calibration cache), TensorRT <= 10 only.

Explicit quantization (the Q/DQ model) is edged's INT8 path; this one exists for models whose Q/DQ
form loses accuracy on TensorRT 8/10, and because DLA on those versions takes its INT8 scales from a
calibrator. TensorRT 11 removed it; ``versions.plan_build`` refuses it there.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edged.backends.tensorrt.cuda import driver
from edged.cache import atomic_write
from edged.errors import BuildError

if TYPE_CHECKING:
    import tensorrt as trt

log = logging.getLogger(__name__)

Sample = dict[str, np.ndarray]


def load_samples(folder: str, inputs: Mapping[str, tuple[str, int]], max_samples: int) -> list[Sample]:
    """Calibration samples from a folder: ``.npz`` files keyed by input name, or, for a model with
    one input, ``.npy`` files. ``inputs`` maps each input to (numpy dtype, rank); a sample one
    rank short gets the batch dimension added."""
    try:
        files = sorted(p for p in Path(folder).iterdir() if p.suffix in (".npy", ".npz"))
    except OSError as e:
        raise BuildError(f"calibration data {folder}: {e.strerror}") from None
    if not files:
        raise BuildError(f"calibration data {folder}: no .npy or .npz samples")
    return [_sample(f, inputs) for f in files[:max_samples]]


def _sample(path: Path, inputs: Mapping[str, tuple[str, int]]) -> Sample:
    if path.suffix == ".npy":
        if len(inputs) != 1:
            raise BuildError(f"{path.name}: a model with {len(inputs)} inputs needs .npz samples")
        raw = {next(iter(inputs)): np.load(path, allow_pickle=False)}
    else:
        with np.load(path, allow_pickle=False) as npz:
            raw = {name: npz[name] for name in npz.files}
    missing = sorted(set(inputs) - set(raw))
    if missing:
        raise BuildError(f"{path.name}: no array for input(s) {', '.join(missing)}")
    sample: Sample = {}
    for name, (dtype, rank) in inputs.items():
        arr = np.asarray(raw[name], dtype=dtype)
        if arr.ndim == rank - 1:
            arr = arr[np.newaxis]
        if arr.ndim != rank:
            raise BuildError(f"{path.name}: input {name!r} has rank {arr.ndim}, model {rank}")
        sample[name] = np.ascontiguousarray(arr)
    return sample


def make_calibrator(samples: Sequence[Sample], cache_path: str) -> trt.IInt8EntropyCalibrator2:
    """An entropy calibrator feeding ``samples`` one by one from device buffers it owns (freed
    with it; the build process ends right after); it reads and writes ``cache_path`` so a rebuild
    with the same data skips the calibration runs."""
    import tensorrt as trt

    class _Entropy(trt.IInt8EntropyCalibrator2):  # type: ignore[misc, unused-ignore]  # as in trtlog
        def __init__(self) -> None:
            trt.IInt8EntropyCalibrator2.__init__(self)
            self._next = 0
            self._device: dict[str, Any] = {}

        def get_batch_size(self) -> int:
            # Explicit-batch networks take the batch from the sample's own first dimension.
            return 1

        def get_batch(self, names: list[str]) -> list[int]:
            if self._next >= len(samples):
                return []  # no more samples: calibration ends
            sample = samples[self._next]
            self._next += 1
            cuda = driver()
            for name in names:
                arr = sample[name]
                if name not in self._device:
                    largest = max(s[name].nbytes for s in samples)
                    self._device[name] = cuda.mem_alloc(largest)
                cuda.memcpy_htod(self._device[name], arr)
            return [int(self._device[name]) for name in names]

        # None (no cache yet) makes TensorRT calibrate.
        def read_calibration_cache(self) -> bytes | None:
            try:
                with open(cache_path, "rb") as f:
                    log.info("using calibration cache %s", cache_path)
                    return f.read()
            except FileNotFoundError:
                return None

        def write_calibration_cache(self, cache: Any) -> None:
            os.makedirs(os.path.dirname(cache_path) or ".", exist_ok=True)
            atomic_write(Path(cache_path), bytes(cache))

    return _Entropy()
