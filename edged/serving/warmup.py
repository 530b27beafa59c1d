"""Warm-up inputs: random tensors at the profile's optimal shape, a sample file, or inputs
given one by one (a shape each, and zeros, random data or a file of the tensor's raw bytes: a
Triton model_warmup sample).

Random data is enough to page in weights, build kernels' caches and start thread pools; a model
whose work depends on the data (detection post-processing, early exits) should be warmed with a
real sample file.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from edged.backends.base import TensorSpec
from edged.config import ModelConfig, WarmupInput
from edged.errors import ConfigError, EdgedError
from edged.wire.tensors import from_bytes

log = logging.getLogger(__name__)

# A dynamic dimension with no profile: batch 1, and a small spatial size that every
# convolutional model accepts (a multiple of 32).
_DEFAULT_BATCH, _DEFAULT_DIM = 1, 64


def concrete_shape(spec: TensorSpec, model: ModelConfig) -> tuple[int, ...]:
    given = model.warmup.inputs
    if isinstance(given, dict) and spec.name in given:
        return tuple(given[spec.name].shape)
    profile = model.profiles.get(spec.name)
    if profile is not None:
        return tuple(profile.opt)
    return tuple(d if d >= 0 else (_DEFAULT_BATCH if i == 0 else _DEFAULT_DIM) for i, d in enumerate(spec.shape))


def random_tensor(spec: TensorSpec, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    dtype = spec.np_dtype
    if dtype.kind == "f":
        return rng.random(shape, dtype=np.float32).astype(dtype, copy=False)
    if dtype.kind in "iu":
        return rng.integers(0, 2, size=shape).astype(dtype)
    if dtype.kind == "O":
        # BYTES: text every string model reads, and a number for those that parse one (Triton's
        # string examples do, and a repository without model_warmup must still come up warm).
        return np.full(shape, b"0", dtype=object)
    return np.zeros(shape, dtype=dtype)


def warm_inputs(specs: tuple[TensorSpec, ...], model: ModelConfig) -> dict[str, np.ndarray]:
    source = model.warmup.inputs
    if isinstance(source, dict):
        return _given(source, specs)
    if source != "random":
        return _from_file(source, specs)
    rng = np.random.default_rng(0)
    return {s.name: random_tensor(s, concrete_shape(s, model), rng) for s in specs}


def _given(inputs: dict[str, WarmupInput], specs: tuple[TensorSpec, ...]) -> dict[str, np.ndarray]:
    missing = [s.name for s in specs if s.name not in inputs]
    unknown = sorted(set(inputs) - {s.name for s in specs})
    if missing or unknown:
        raise ConfigError(f"warm-up inputs {sorted(inputs)} are not the model's inputs {[s.name for s in specs]}")
    rng = np.random.default_rng(0)
    out = {}
    for spec in specs:
        given = inputs[spec.name]
        shape = tuple(given.shape)
        if given.file:
            out[spec.name] = _raw_file(given.file, spec, shape)
        elif given.data == "zero":
            out[spec.name] = (
                np.full(shape, b"", dtype=object) if spec.np_dtype.kind == "O" else np.zeros(shape, spec.np_dtype)
            )
        else:
            out[spec.name] = random_tensor(spec, shape, rng)
    return out


def _raw_file(path: str, spec: TensorSpec, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor from a file of its raw bytes, row-major (BYTES: length-prefixed elements)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(f"warm-up input '{spec.name}': cannot read {path}: {e.strerror}") from None
    try:
        return from_bytes(data, spec.np_dtype, shape, f"warm-up input '{spec.name}' ({path})")
    except EdgedError as e:
        raise ConfigError(e.message) from None


def _from_file(path: str, specs: tuple[TensorSpec, ...]) -> dict[str, np.ndarray]:
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ConfigError(f"warm-up sample {path} is not a .npy/.npz file: {e}") from None
    if isinstance(data, np.lib.npyio.NpzFile):
        with data:
            missing = [s.name for s in specs if s.name not in data.files]
            if missing:
                raise ConfigError(f"warm-up sample {path} has no array for inputs {missing}")
            return {s.name: np.asarray(data[s.name], dtype=s.np_dtype) for s in specs}
    if len(specs) != 1:
        raise ConfigError(f"warm-up sample {path} is a single array; the model has {len(specs)} inputs")
    return {specs[0].name: np.asarray(data, dtype=specs[0].np_dtype)}


# Work a request may do on the event loop: the inline path is for requests whose run costs about
# as much as the hand-off to a worker, never for one that holds every other client up.
INLINE_BUDGET_US = 1000.0


def inline_max_elements(specs: tuple[TensorSpec, ...], model: ModelConfig, infer_us: float) -> int:
    """The most input elements a request to an inline model may have and still run on the loop:
    the warm-up's element count, scaled (linearly, which overestimates the cost of a small
    model's larger request) to what fits in INLINE_BUDGET_US given the measured run time."""
    warm = sum(math.prod(concrete_shape(s, model)) for s in specs)
    return max(warm, int(warm * INLINE_BUDGET_US / max(infer_us, 1.0)))


# --- one run's cost: what decides whether a model runs on the event loop ----------------------

# Samples the cost of an inline candidate is read from: a model whose warm-up runs came near the
# threshold (within _CANDIDATE times it: three warm-up runs on a busy host can all be slow) gets
# more timed runs after its warm-up, up to this many samples in all.
INLINE_SAMPLES = 16
_CANDIDATE = 4.0
# Those extra runs stop once they have taken this long in all (normally they take well under a
# millisecond), so a model that only looked cheap cannot hold the start up; a single run the host
# delayed by a scheduler slice or two does not reach it.
_EXTRA_RUNS_BUDGET_US = 100_000.0


def run_cost_us(samples_us: Sequence[float]) -> float:
    """One run's cost from timed runs: their lower quartile. What a shared host adds to a run
    (preemption, caches another process evicted, another model warming beside it) only ever adds
    time, so a low percentile reads the model's own cost, where the median of three warm-up
    runs flipped across server.inline_threshold_us between starts of the same daemon. A
    quartile still needs a quarter of the runs to be that fast: a model that really costs more
    is not made to look cheap by one fast run."""
    return float(np.percentile(samples_us, 25))


def timed_us(run: Callable[[], object], clock: Callable[[], float]) -> float:
    """One run's wall time in microseconds on ``clock``."""
    t0 = clock()
    run()
    return (clock() - t0) * 1e6


def warm_cost_us(
    runs: Sequence[Callable[[], object]],
    iterations: int,
    inline_threshold_us: float | None,
    clock: Callable[[], float] = time.perf_counter,
) -> float | None:
    """Warm each instance (``runs``: one callable per instance, running the warm-up inputs)
    ``iterations`` times and return one run's cost in microseconds; None without warm-up runs.
    Each instance's first run pays for what warm-up is for (allocations, kernel caches, thread
    pools): it is left out of the cost. ``inline_threshold_us``: set when the model may run on
    the loop (one instance, not a generator); if its runs came near it, instance 0 runs again
    until there are INLINE_SAMPLES samples, so that the decision rests on enough runs."""
    if iterations <= 0 or not runs:
        return None
    samples: list[float] = []
    fastest = math.inf
    for run in runs:
        times = [timed_us(run, clock) for _ in range(iterations)]
        fastest = min(fastest, *times)
        samples += times[1:] or times
    if inline_threshold_us is None or fastest >= _CANDIDATE * inline_threshold_us:
        return run_cost_us(samples)
    extra, added = 0.0, 0
    while len(samples) < INLINE_SAMPLES:
        if extra >= _EXTRA_RUNS_BUDGET_US:
            # Out of budget before enough samples: these runs averaged several milliseconds (the
            # budget over fewer than INLINE_SAMPLES runs): not cheap, whatever the quartile says.
            return max(run_cost_us(samples), extra / added)
        took = timed_us(runs[0], clock)
        samples.append(took)
        extra += took
        added += 1
    return run_cost_us(samples)


# A model whose runs on a worker thread measured between the inline threshold and this may be
# cheaper than that: a thread's run waits for the GIL after it, which a busy loop holds (the tiny
# MLP measured 281 us against 23 us when its built engine was warmed while its stand-in served
# four clients, and stayed off the loop for the daemon's life). It is timed again on the loop.
LOOP_CHECK_MAX_US = 500.0
_LOOP_SLICE_S = 0.001


async def loop_cost_us(run: Callable[[], object], clock: Callable[[], float] = time.perf_counter) -> float:
    """One run's cost measured on the event loop, which holds the GIL: INLINE_SAMPLES runs, their
    lower quartile, back to back as a thread's warm-up runs them (runs with requests served
    between them measured 40-65 us for the tiny MLP's 23 us, their caches cold), in slices of
    about a millisecond between which the loop serves what is ready. Only for a model whose cost
    on a thread was under LOOP_CHECK_MAX_US (the caller checks it): its runs on the loop cost no
    more. For a model that would run there: the cost it would have inline."""
    samples: list[float] = []
    while len(samples) < INLINE_SAMPLES:
        await asyncio.sleep(0)
        began = clock()
        while len(samples) < INLINE_SAMPLES and clock() - began < _LOOP_SLICE_S:
            samples.append(timed_us(run, clock))
    return run_cost_us(samples)
