"""Building an engine: ONNX → network → builder config → serialized plan.

Runs in the build child process with the device's primary context active. Every choice that
depends on the TensorRT version was made by ``versions.plan_build``; this module applies it. The
timing cache is kept per device fingerprint beside the engines, so a rebuild (a new model version,
a cleared entry) reuses the tactic timings of earlier builds on the same GPU and TensorRT.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edged.backends.base import BuildSpec, Progress
from edged.backends.tensorrt.calibrator import load_samples, make_calibrator
from edged.backends.tensorrt.shapes import Profile, Shape, dims, numpy_dtype, resolve_profiles
from edged.backends.tensorrt.trtlog import capture_errors, get_logger
from edged.backends.tensorrt.versions import (
    BuildOptions,
    BuildPlan,
    parse_version,
    plan_build,
    read_model_traits,
)
from edged.cache import atomic_write, file_digest
from edged.errors import BuildError

if TYPE_CHECKING:
    import tensorrt as trt

log = logging.getLogger(__name__)

NetworkInput = tuple[str, Shape, str]  # name, shape (-1 dynamic), numpy dtype


def build_engine(spec: BuildSpec, dest: Path, progress: Progress, fingerprint: Mapping[str, str]) -> dict[str, Any]:
    """Build ``spec`` into a serialized engine at ``dest``; return the manifest's extra fields."""
    import tensorrt as trt

    started = time.monotonic()
    opts = BuildOptions.from_mapping(spec.options)
    progress("parsing", None)
    plan = plan_build(parse_version(trt.__version__), spec.precision, opts, read_model_traits(spec.source), spec.source)
    for note in plan.notes:
        log.warning("%s: %s", spec.source, note)
    builder = trt.Builder(get_logger())
    network = builder.create_network(_network_flags(plan))
    parser = trt.OnnxParser(network, get_logger())
    _parse(parser, spec.source)
    inputs = _network_inputs(network)
    profiles = resolve_profiles([(n, s) for n, s, _ in inputs], spec.profiles)
    config = builder.create_builder_config()
    _configure(builder, config, plan, opts)
    profile = _add_profile(builder, config, profiles)
    timing_path = timing_cache_path(opts, dest, fingerprint)
    _load_timing_cache(config, timing_path)
    calibrator = None
    if plan.calibrator:
        calibrator = _attach_calibrator(config, profile, inputs, opts, spec, timing_path.parent)
    progress("building", None)
    with capture_errors() as errors:
        serialized = builder.build_serialized_network(network, config)
    del calibrator  # kept alive through the build: TensorRT calls back into it
    if serialized is None:
        raise BuildError(
            "TensorRT could not build the engine: " + ("; ".join(errors[-5:]) or "see the log for TensorRT's reasons")
        )
    with open(dest, "wb") as f:
        f.write(serialized)
    _save_timing_cache(config, timing_path)
    progress("building", 1.0)
    return _manifest(trt.__version__, plan, opts, timing_path, time.monotonic() - started)


def _manifest(version: str, plan: BuildPlan, opts: BuildOptions, timing_path: Path, seconds: float) -> dict[str, Any]:
    return {
        "tensorrt": version,
        "strongly_typed": plan.strongly_typed,
        "builder_flags": list(plan.builder_flags),
        "legacy_calibrator": plan.calibrator,
        "dla_core": plan.dla_core,
        "workspace": opts.workspace,
        "builder_optimization_level": plan.optimization_level,
        "timing_cache": timing_path.name,
        "build_s": round(seconds, 1),
    }


def _network_flags(plan: BuildPlan) -> int:
    import tensorrt as trt

    flags = 0
    for name in plan.network_flags:
        if name == "EXPLICIT_BATCH":
            flags |= 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
        elif name == "STRONGLY_TYPED":
            flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
        else:
            raise BuildError(f"unknown network flag {name}")
    return flags


def _builder_flag(name: str) -> trt.BuilderFlag:
    import tensorrt as trt

    # Member by member rather than getattr: TensorRT 11 has no INT8/FP16 members at all, and
    # the plan never names them there.
    if name == "INT8":
        return trt.BuilderFlag.INT8
    if name == "FP16":
        return trt.BuilderFlag.FP16
    if name == "GPU_FALLBACK":
        return trt.BuilderFlag.GPU_FALLBACK
    raise BuildError(f"unknown builder flag {name}")


def _parse(parser: trt.OnnxParser, source: str) -> None:
    # parse_from_file, not parse(bytes): it finds the external weight files beside the model.
    if not parser.parse_from_file(source):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise BuildError(f"TensorRT cannot parse {source}: " + "; ".join(errors[:5]))


def _network_inputs(network: trt.INetworkDefinition) -> list[NetworkInput]:
    inputs = []
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        inputs.append((tensor.name, dims(tensor.shape), numpy_dtype(tensor.dtype.name, tensor.name)))
    return inputs


def _configure(builder: trt.Builder, config: trt.IBuilderConfig, plan: BuildPlan, opts: BuildOptions) -> None:
    import tensorrt as trt

    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, opts.workspace)
    if plan.optimization_level is not None:
        config.builder_optimization_level = plan.optimization_level
    for name in plan.builder_flags:
        config.set_flag(_builder_flag(name))
    if plan.dla_core >= 0:
        cores = builder.num_DLA_cores
        if plan.dla_core >= cores:
            raise BuildError(f"tensorrt.dla_core = {plan.dla_core}, but this device has {cores} DLA core(s)")
        config.default_device_type = trt.DeviceType.DLA
        config.DLA_core = plan.dla_core


def _add_profile(
    builder: trt.Builder, config: trt.IBuilderConfig, profiles: Mapping[str, Profile]
) -> trt.IOptimizationProfile | None:
    import tensorrt as trt

    if not profiles:
        return None
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in profiles.items():
        profile.set_shape(name, trt.Dims(list(lo)), trt.Dims(list(opt)), trt.Dims(list(hi)))
    config.add_optimization_profile(profile)
    return profile


def timing_cache_path(opts: BuildOptions, dest: Path, fingerprint: Mapping[str, str]) -> Path:
    """One timing cache per device fingerprint (TensorRT version, GPU, driver, L4T), in
    ``timing/`` beside the engines unless the config names a file."""
    if opts.timing_cache:
        return Path(opts.timing_cache)
    canon = json.dumps(dict(fingerprint), sort_keys=True).encode()
    return dest.parent / "timing" / f"{hashlib.sha256(canon).hexdigest()[:20]}.cache"


def _load_timing_cache(config: trt.IBuilderConfig, path: Path) -> None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        data = b""
    except OSError as e:
        log.warning("cannot read timing cache %s (%s); timing from scratch", path, e)
        data = b""
    try:
        cache = config.create_timing_cache(data)
        if data and (cache is None or not config.set_timing_cache(cache, False)):
            raise ValueError("TensorRT rejected it")
    except Exception as e:  # a damaged or foreign cache costs timing, never the build
        log.warning("timing cache %s unusable (%s); timing from scratch", path, e)
        cache = config.create_timing_cache(b"")
    config.set_timing_cache(cache, False)


def _save_timing_cache(config: trt.IBuilderConfig, path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, bytes(config.get_timing_cache().serialize()))
    except OSError as e:  # a lost timing cache only makes the next build slower
        log.warning("cannot save timing cache %s: %s", path, e)


def _attach_calibrator(
    config: trt.IBuilderConfig,
    profile: trt.IOptimizationProfile | None,
    inputs: list[NetworkInput],
    opts: BuildOptions,
    spec: BuildSpec,
    cache_dir: Path,
) -> trt.IInt8EntropyCalibrator2:
    samples = load_samples(
        opts.calibration_data, {name: (dtype, len(shape)) for name, shape, dtype in inputs}, opts.max_samples
    )
    cache_path = opts.calibration_cache or str(cache_dir / f"calib-{_calibration_digest(spec.source, opts)}.cache")
    calibrator = make_calibrator(samples, cache_path)
    config.int8_calibrator = calibrator
    if profile is not None:  # dynamic shapes: calibration runs at this profile's opt shapes
        config.set_calibration_profile(profile)
    log.info("calibrating %s on %d samples (cache %s)", spec.source, len(samples), cache_path)
    return calibrator


def _calibration_digest(source: str, opts: BuildOptions) -> str:
    """A calibration cache is valid for one model and one sample set."""
    h = hashlib.sha256(file_digest(source).encode())
    for entry in sorted(os.scandir(opts.calibration_data), key=lambda e: e.name):
        st = entry.stat()
        h.update(f"{entry.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    h.update(str(opts.max_samples).encode())
    return h.hexdigest()[:20]
