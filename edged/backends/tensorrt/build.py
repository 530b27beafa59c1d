"""Building an engine: ONNX → network → builder config → serialized plan.

Runs in the build child process with the device's primary context active. Every choice that
depends on the TensorRT version was made by ``versions.plan_build``; this module applies it, and
each name only some releases have sits under the version check of ``versions`` that admits it
(tests/unit/test_tensorrt_release_names.py holds every name to every release it can run on). The timing
cache is the device's one (``timing.py``), shared by every build and every trial.

A build whose recipe converts the Q/DQ model's float parts to FP16 (strongly typed int8) and then
fails (the conversion, TensorRT's parser, or the builder) is tried once more with the safer
recipe, ``float_parts = "fp32"``: the model as quantized. The manifest records that and why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edged.backends.base import BuildSpec, Progress
from edged.backends.tensorrt.calibrator import BatchFeeder, make_calibrator
from edged.backends.tensorrt.fingerprint import board_model
from edged.backends.tensorrt.fp16 import to_mixed_fp16
from edged.backends.tensorrt.profiles import shares_profiles_by_flag
from edged.backends.tensorrt.shapes import Profile, Shape, dims, numpy_dtype, resolve_profiles
from edged.backends.tensorrt.timing import TimingCache, timing_cache_path
from edged.backends.tensorrt.trtlog import capture_errors, get_logger
from edged.backends.tensorrt.versions import (
    LEGACY_REFUSED,
    BuildOptions,
    BuildPlan,
    Version,
    check_dla,
    dla_cores_error,
    has_explicit_batch_flag,
    has_optimization_level,
    has_strongly_typed_flag,
    has_weak_typing,
    parse_version,
    plan_build,
    read_model_traits,
)
from edged.cache.store import file_digest
from edged.errors import BuildError

if TYPE_CHECKING:
    import tensorrt as trt

log = logging.getLogger(__name__)

NetworkInput = tuple[str, Shape, str]  # name, shape (-1 dynamic), numpy dtype
DLA_FALLBACK_LISTED = 50  # layer names kept in the manifest; the count is always exact
SAFER_FLOAT_PARTS = "fp32"


class _RecipeFailed(Exception):
    """The steps the recipe decides (the FP16 conversion, the parse, the build) failed."""

    def __init__(self, error: BuildError) -> None:
        super().__init__(str(error))
        self.error = error


def build_engine(spec: BuildSpec, dest: Path, progress: Progress, fingerprint: Mapping[str, str]) -> dict[str, Any]:
    """Build ``spec`` into a serialized engine at ``dest``; return the manifest's extra fields."""
    import tensorrt as trt

    started = time.monotonic()
    opts = BuildOptions.from_mapping(spec.options)
    version = parse_version(trt.__version__)
    progress("parsing", None)
    traits = read_model_traits(spec.source)
    plan = plan_build(version, spec.precision, opts, traits, spec.source, samples=spec.calibration is not None)
    for note in plan.notes:
        log.warning("%s: %s", spec.source, note)
    root = Path(spec.cache_dir) if spec.cache_dir else dest.parent
    timing = TimingCache(timing_cache_path(opts.timing_cache, root, fingerprint), root)
    try:
        extra = _attempt(spec, dest, progress, plan, opts, timing)
    except _RecipeFailed as failed:
        if not plan.fp16_float_parts:
            raise failed.error from None
        extra = _retry_safer(spec, dest, progress, plan, opts, timing, failed.error)
    extra.update(_manifest(trt.__version__, plan, opts, time.monotonic() - started))
    extra.update(timing.manifest())
    return extra


def _retry_safer(
    spec: BuildSpec,
    dest: Path,
    progress: Progress,
    plan: BuildPlan,
    opts: BuildOptions,
    timing: TimingCache,
    first: BuildError,
) -> dict[str, Any]:
    log.warning(
        "%s: the build with float_parts = 'fp16' failed (%s); trying once more with the safer %r",
        spec.source,
        first,
        SAFER_FLOAT_PARTS,
    )
    progress("building (safer recipe)", None)
    safer_opts = dataclasses.replace(opts, float_parts=SAFER_FLOAT_PARTS)
    safer = dataclasses.replace(plan, fp16_float_parts=False)
    try:
        extra = _attempt(spec, dest, progress, safer, safer_opts, timing)
    except _RecipeFailed as second:
        raise BuildError(
            f"TensorRT could not build {Path(spec.source).name} with float_parts = 'fp16' ({first}) nor with "
            f"the safer {SAFER_FLOAT_PARTS!r} ({second.error})"
        ) from None
    extra["retried"] = {"float_parts": SAFER_FLOAT_PARTS, "because": str(first)}
    return extra


def _attempt(
    spec: BuildSpec, dest: Path, progress: Progress, plan: BuildPlan, opts: BuildOptions, timing: TimingCache
) -> dict[str, Any]:
    """One build with one recipe; raises ``_RecipeFailed`` for what another recipe might fix."""
    import tensorrt as trt

    builder = trt.Builder(get_logger())
    network = builder.create_network(_network_flags(plan))
    parser = trt.OnnxParser(network, get_logger())
    try:
        with network_source(spec.source, plan, opts, dest.parent) as (source, float_info):
            _parse(parser, source)
    except BuildError as e:
        raise _RecipeFailed(e) from e
    inputs = _network_inputs(network)
    profiles = resolve_profiles([(n, s) for n, s, _ in inputs], spec.profiles)
    check_dla(plan.version, plan.dla_core, profiles)
    config = builder.create_builder_config()
    _configure(builder, config, plan, opts)
    profile = add_profiles(builder, config, profiles, plan.profile_copies)
    timing.load(config)
    calibrator, feeder = None, None
    if plan.calibrator:
        feeder = calibration_feeder(spec, inputs, profiles)
        calibrator = _attach_calibrator(config, profile, feeder, opts, spec, timing.path.parent, plan.version)
    fallback = dla_gpu_layers(config, network) if plan.dla_core >= 0 else None
    progress("building", None)
    with capture_errors() as errors:
        serialized = builder.build_serialized_network(network, config)
    del calibrator  # kept alive through the build: TensorRT calls back into it
    if feeder is not None and feeder.error is not None:
        raise feeder.error  # TensorRT read it as "no more data" and may even have built
    if serialized is None:
        why = "; ".join(errors[-5:]) or "see the log for TensorRT's reasons"
        raise _RecipeFailed(BuildError(f"TensorRT could not build the engine: {why}"))
    with open(dest, "wb") as f:
        f.write(serialized)
    timing.save(config)
    progress("building", 1.0)
    extra: dict[str, Any] = dict(float_info)
    if fallback is not None:
        extra["dla_gpu_fallback"] = fallback
    if feeder is not None:
        extra["calibration_samples"] = feeder.fed
    return extra


def _manifest(version: str, plan: BuildPlan, opts: BuildOptions, seconds: float) -> dict[str, Any]:
    return {
        "tensorrt": version,
        "strongly_typed": plan.strongly_typed,
        "builder_flags": list(plan.builder_flags),
        "preview_features": list(plan.preview_features),
        "profiles_per_input": plan.profile_copies,
        "legacy_calibrator": plan.calibrator,
        "dla_core": plan.dla_core,
        "device": opts.device,
        "workspace": opts.workspace,
        "builder_optimization_level": plan.optimization_level,
        "build_s": round(seconds, 1),
    }


@contextlib.contextmanager
def network_source(
    source: str, plan: BuildPlan, opts: BuildOptions, workdir: Path
) -> Iterator[tuple[str, dict[str, Any]]]:
    """The model file the parser reads, and what was done to it for the manifest. A strongly
    typed network takes every tensor's type from the model, so the float parts of a Q/DQ model
    would run FP32 (8.x ran them FP16 through the FP16 flag): with ``float_parts = "fp16"`` they
    are converted to FP16 first, outputs and the ops named in ``keep_fp32`` (by default the
    numerically sensitive ones that produce outputs) kept FP32."""
    if not plan.fp16_float_parts:
        yield source, {"float_parts": "fp32" if plan.strongly_typed else "builder flags"}
        return
    with tempfile.TemporaryDirectory(prefix=".tmp-fp16-", dir=workdir) as tmp:
        converted = Path(tmp) / "mixed.onnx"
        summary = to_mixed_fp16(Path(source), converted, opts.keep_fp32, opts.int8_float_nodes)
        yield str(converted), {"float_parts": "fp16", "fp16": summary}


def _network_flags(plan: BuildPlan) -> int:
    import tensorrt as trt

    flags = 0
    for name in plan.network_flags:
        if name == "EXPLICIT_BATCH" and has_explicit_batch_flag(plan.version):
            flags |= 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
        elif name == "STRONGLY_TYPED" and has_strongly_typed_flag(plan.version):
            flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
        else:
            raise BuildError(f"network flag {name} does not exist on TensorRT {_dotted(plan.version)}")
    return flags


def _dotted(version: Version) -> str:
    return ".".join(map(str, version))


def _builder_flag(name: str, version: Version) -> trt.BuilderFlag:
    import tensorrt as trt

    # Member by member rather than getattr, each under the check of the releases that have it:
    # TensorRT 11 has no INT8/FP16 members at all (the plan never names them there).
    if name == "INT8" and has_weak_typing(version):
        return trt.BuilderFlag.INT8
    if name == "FP16" and has_weak_typing(version):
        return trt.BuilderFlag.FP16
    if name == "GPU_FALLBACK":
        return trt.BuilderFlag.GPU_FALLBACK
    raise BuildError(f"builder flag {name} does not exist on TensorRT {_dotted(version)}")


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
    if has_optimization_level(plan.version) and plan.optimization_level is not None:
        config.builder_optimization_level = plan.optimization_level
    for name in plan.builder_flags:
        config.set_flag(_builder_flag(name, plan.version))
    for name in plan.preview_features:
        if name != "PROFILE_SHARING_0806" or not shares_profiles_by_flag(plan.version):
            raise BuildError(f"preview feature {name} is not for TensorRT {_dotted(plan.version)}")
        config.set_preview_feature(trt.PreviewFeature.PROFILE_SHARING_0806, True)
    if plan.dla_core >= 0:
        cores = builder.num_DLA_cores
        if plan.dla_core >= cores:
            raise BuildError(dla_cores_error(plan.dla_core, cores, board_model()))
        config.default_device_type = trt.DeviceType.DLA
        config.DLA_core = plan.dla_core


def add_profiles(
    builder: trt.Builder, config: trt.IBuilderConfig, profiles: Mapping[str, Profile], copies: int
) -> trt.IOptimizationProfile | None:
    """``copies`` identical profiles (one per execution context on TensorRT 8.5, else one);
    returns the first, which the legacy calibrator calibrates at."""
    import tensorrt as trt

    if not profiles:
        return None
    first = None
    for _ in range(copies):
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in profiles.items():
            profile.set_shape(name, trt.Dims(list(lo)), trt.Dims(list(opt)), trt.Dims(list(hi)))
        if config.add_optimization_profile(profile) < 0:
            raise BuildError("TensorRT refused the optimization profile; the log says why")
        first = first or profile
    return first


def dla_gpu_layers(config: trt.IBuilderConfig, network: trt.INetworkDefinition) -> dict[str, Any]:
    """The layers TensorRT says cannot run on the DLA (they fall back to the GPU), for the
    manifest and so the status."""
    names = [
        network.get_layer(i).name for i in range(network.num_layers) if not config.can_run_on_DLA(network.get_layer(i))
    ]
    if names:
        log.warning("%d of %d layers cannot run on the DLA and fall back to the GPU", len(names), network.num_layers)
    return {"layers": names[:DLA_FALLBACK_LISTED], "count": len(names), "of": network.num_layers}


def calibration_feeder(spec: BuildSpec, inputs: list[NetworkInput], profiles: Mapping[str, Profile]) -> BatchFeeder:
    """The legacy calibrator's samples, checked against the shapes TensorRT calibrates at: a
    dynamic input's profile ``opt`` shape, a static input's own shape."""
    shapes = {name: (tuple(profiles[name][1]) if name in profiles else shape, dtype) for name, shape, dtype in inputs}
    return BatchFeeder(spec.calibration.named_feeds(), shapes)


def calibration_digest(source: str, samples_digest: str) -> str:
    """A calibration cache is valid for one model and one sample set (the loader's digest)."""
    return hashlib.sha256(f"{file_digest(source)}:{samples_digest}".encode()).hexdigest()[:20]


def _attach_calibrator(
    config: trt.IBuilderConfig,
    profile: trt.IOptimizationProfile | None,
    feeder: BatchFeeder,
    opts: BuildOptions,
    spec: BuildSpec,
    cache_dir: Path,
    version: Version,
) -> trt.IInt8EntropyCalibrator2:
    if not has_weak_typing(version):  # the plan refuses it there first; the names are gone in 11
        raise BuildError(LEGACY_REFUSED.format(v=_dotted(version)))
    digest = calibration_digest(spec.source, str(spec.calibration.digest))
    cache_path = opts.calibration_cache or str(cache_dir / f"calib-{digest}.cache")
    calibrator = make_calibrator(feeder, cache_path, version)
    config.int8_calibrator = calibrator
    if profile is not None:  # dynamic shapes: calibration runs at this profile's opt shapes
        config.set_calibration_profile(profile)
    log.info("calibrating %s on %d sample files (cache %s)", spec.source, len(spec.calibration), cache_path)
    return calibrator
