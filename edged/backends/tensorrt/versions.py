"""The TensorRT version layer: every difference between 8.5, 8.6, 10.x and 11.x, decided here.

Inference is the same on all of them (named I/O tensors, ``set_input_shape``,
``set_tensor_address`` and ``execute_async_v3`` exist from 8.5 on), so only the build differs:

- 8.5/8.6 (JetPack 5, 6.0): an explicit-batch network; INT8 from a Q/DQ model needs the INT8
  builder flag, and FP16 lets the layers between Q/DQ pairs run in half precision.
- 10.x (JetPack 6.1/6.2, 7): networks are always explicit batch; a Q/DQ model builds as a strongly
  typed network, so the model alone decides every tensor's type. FP16 from an FP32 model still
  goes through the (deprecated) FP16 flag on a weakly typed network.
- 11.x: weak typing is gone (no FP16/INT8 flags, no calibrator): every network is strongly typed,
  so FP16 needs a model whose tensors are already FP16 (ModelOpt AutoCast).

This module imports neither tensorrt nor onnx at import time: the unit tests decide every version
on a machine without TensorRT, and ``build.py`` only applies the plan it returns.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from edged.backends.tensorrt.profiles import profile_scheme, shares_profiles_by_flag
from edged.errors import BuildError

log = logging.getLogger(__name__)

Version = tuple[int, int, int]
MIN_VERSION: Version = (8, 5, 0)
NEWEST_MAJOR = 11  # the newest major release this code was written against
# Part of every engine's cache key (``TensorRTBackend.build_recipe``): change it with any change
# to what the build makes of the same inputs (the plan, the FP16 pass, the retry), so that
# engines already cached are rebuilt the new way instead of served as they were.
BUILD_RECIPE = "2"

LEGACY_REFUSED = (
    "tensorrt.legacy_calibrator is not available on TensorRT {v}: implicit INT8 calibration was "
    "removed in TensorRT 11. Set legacy_calibrator = false; edged then builds INT8 from the "
    "calibrated Q/DQ model (explicit quantization), which every TensorRT version supports"
)
FP16_NEEDS_TYPED_MODEL = (
    "fp16 on TensorRT {v} needs a model whose tensors are FP16: TensorRT 11 removed the FP16 "
    "builder flag and builds every network strongly typed. Convert the model first with "
    "ModelOpt AutoCast (python -m modelopt.onnx.autocast --onnx_path model.onnx "
    "--output_path model_fp16.onnx --keep_io_types) and point the model's path at the result, "
    "or use precision int8 or fp32"
)
INT8_NEEDS_QDQ = (
    "int8 needs a Q/DQ model (explicit quantization: QuantizeLinear/DequantizeLinear nodes), got "
    "{source} without any; the build step calibrates and writes that model before calling "
    "TensorRT"
)


def parse_version(text: str) -> Version:
    """``"10.3.0.30"`` → ``(10, 3, 0)``; missing parts are 0."""
    parts = [int(p) for p in re.findall(r"\d+", text)[:3]]
    if not parts:
        raise ValueError(f"not a TensorRT version: {text!r}")
    parts += [0] * (3 - len(parts))
    return parts[0], parts[1], parts[2]


def unsupported_reason(version: Version) -> str:
    """Why this TensorRT cannot be used, or "" when it can."""
    if version < MIN_VERSION:
        return (
            f"TensorRT {'.'.join(map(str, version))} is older than 8.5, which introduced the "
            "named I/O tensor API edged runs on (JetPack 5 ships 8.5)"
        )
    return ""


# --- the version checks the code branches on ---------------------------------------------------
#
# A TensorRT name the backend uses where only some releases have it sits under one of these (an
# ``if``, a conditional expression, or an early ``raise`` that leaves the rest of a function to
# the releases it admits). tests/unit/test_tensorrt_release_names.py evaluates them on every release's
# version to know which names each release must have (scripts/data/tensorrt_api.json).


def uses_device_memory_v2(version: Version) -> bool:
    """``device_memory_size_v2`` exists from 10.1; 11 removed the old property."""
    return version >= (10, 1, 0)


def has_weak_typing(version: Version) -> bool:
    """8.x and 10.x: the INT8/FP16 builder flags, ``EXPLICIT_BATCH`` and the implicit INT8
    calibrator (``IInt8EntropyCalibrator2``, ``int8_calibrator``); 11.0 removed them all."""
    return version < (11, 0, 0)


def has_explicit_batch_flag(version: Version) -> bool:
    """``NetworkDefinitionCreationFlag.EXPLICIT_BATCH``: needed on 8.x, deprecated in 10 (every
    network is explicit batch), gone in 11."""
    return version < (11, 0, 0)


def has_strongly_typed_flag(version: Version) -> bool:
    """``NetworkDefinitionCreationFlag.STRONGLY_TYPED``: not in 8.x."""
    return version >= (10, 0, 0)


def has_optimization_level(version: Version) -> bool:
    """``IBuilderConfig.builder_optimization_level`` arrived in 8.6."""
    return version >= (8, 6, 0)


def dla_supported(version: Version) -> bool:
    """DLA: 8.5 to 10.7 (10.7 was the last 10.x with DLA), then again from 11.4.1 (Jetson AGX
    Orin, JetPack 7.2.2+; 11.4.0 had DLA on Windows on ARM only)."""
    return version < (10, 8, 0) or version >= (11, 4, 1)


VERSION_CHECKS: dict[str, Callable[[Version], bool]] = {
    f.__name__: f
    for f in (
        uses_device_memory_v2,
        has_weak_typing,
        has_explicit_batch_flag,
        has_strongly_typed_flag,
        has_optimization_level,
        dla_supported,
        shares_profiles_by_flag,
    )
}


@dataclass(frozen=True)
class ModelTraits:
    """What the build needs to know about the ONNX model before choosing a network type."""

    qdq: bool  # holds QuantizeLinear/DequantizeLinear nodes (explicitly quantized)
    fp16: bool  # holds float16 tensors (already converted to half precision)


def read_model_traits(path: str) -> ModelTraits:
    """Scan the graph (not the weights: external data is not loaded) for Q/DQ nodes and FP16."""
    import onnx  # lazily: only builds need it, and it costs ~100 ms to import

    model = onnx.load(path, load_external_data=False)
    graph = model.graph
    fp16 = onnx.TensorProto.FLOAT16
    qdq = any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in graph.node)
    typed = [*graph.input, *graph.output, *graph.value_info]
    has_fp16 = (
        any(v.type.tensor_type.elem_type == fp16 for v in typed)
        or any(t.data_type == fp16 for t in graph.initializer)
        or any(a.name == "to" and a.i == fp16 for n in graph.node if n.op_type == "Cast" for a in n.attribute)
    )
    return ModelTraits(qdq=qdq, fp16=has_fp16)


def _size(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise BuildError(f"tensorrt option {key}: expected bytes or a size such as '1GiB'")
    if isinstance(value, int):
        return value
    # Imported here: edged.config pulls in msgspec, which a GPU test machine need not have.
    from edged.config import parse_size

    try:
        return parse_size(value)
    except ValueError as e:
        raise BuildError(f"tensorrt option {key}: {e}") from None


_OPTION_TYPES: dict[str, type] = {
    "dla_core": int,
    "legacy_calibrator": bool,
    "builder_optimization_level": int,
    "timing_cache": str,
    "calibration_cache": str,
    "instances": int,
    "device": int,
    "keep_fp32": list,
    "float_parts": str,
    "int8_float_nodes": list,
}


@dataclass(frozen=True)
class BuildOptions:
    """The TensorRT part of ``BuildSpec.options``: the keys of ``[models.X.tensorrt]``, and
    ``instances`` where the engine needs one profile per instance (TensorRT 8.5)."""

    workspace: int = 1 << 30
    dla_core: int = -1
    legacy_calibrator: bool = False
    builder_optimization_level: int = 3
    timing_cache: str = ""  # file; "" = timing/ beside the engine, one per device fingerprint
    calibration_cache: str = ""  # legacy calibrator only; "" = beside the timing cache
    instances: int = 1  # concurrent execution contexts (8.5 builds one profile for each)
    device: int = 0  # the GPU ordinal the engine is built on, and later loaded on
    float_parts: str = "fp16"  # strongly typed int8: the unquantized float ops in fp16 or fp32
    keep_fp32: tuple[str, ...] = ()  # op types or node names kept FP32 (with float_parts fp16)
    int8_float_nodes: tuple[str, ...] = ()  # the Q/DQ model's nodes the mixed-precision search kept float

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> BuildOptions:
        values: dict[str, Any] = {}
        for key, value in options.items():
            if key == "workspace":
                values[key] = _size(value, key)
            elif key in _OPTION_TYPES:
                want = _OPTION_TYPES[key]
                if want is list and isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
                    values[key] = tuple(value)
                elif type(value) is want and want is not list:
                    values[key] = value
                else:
                    raise BuildError(f"tensorrt option {key}: expected {want.__name__}")
            else:  # options shared with other backends are not ours to judge
                log.debug("tensorrt build ignores option %r", key)
        opts = cls(**values)
        if opts.workspace <= 0 or opts.dla_core < -1 or opts.instances < 1 or opts.device < 0:
            raise BuildError(
                "tensorrt options: workspace and instances must be positive, device a GPU ordinal, "
                "dla_core -1 (GPU) or a core number"
            )
        if opts.float_parts not in ("fp16", "fp32"):
            raise BuildError("tensorrt option float_parts: expected 'fp16' or 'fp32'")
        if not 0 <= opts.builder_optimization_level <= 5:
            raise BuildError("tensorrt option builder_optimization_level: expected 0..5")
        return opts


@dataclass(frozen=True)
class BuildPlan:
    """How to build on one TensorRT version; ``build.py`` applies it without further decisions."""

    network_flags: tuple[str, ...]  # NetworkDefinitionCreationFlag names
    strongly_typed: bool
    builder_flags: tuple[str, ...]  # BuilderFlag names
    calibrator: bool  # attach the legacy entropy calibrator
    optimization_level: int | None  # None: this version has no builder_optimization_level
    dla_core: int
    notes: tuple[str, ...] = ()  # warnings for the build log
    preview_features: tuple[str, ...] = ()  # PreviewFeature names to enable
    profile_copies: int = 1  # identical optimization profiles (one per instance on 8.5)
    fp16_float_parts: bool = False  # convert a Q/DQ model's float parts to FP16 (strongly typed)
    version: Version = MIN_VERSION  # the TensorRT it was made for; build.py checks names by it


def _precision_plan(
    major: int, precision: str, opts: BuildOptions, traits: ModelTraits, source: str, samples: bool
) -> tuple[bool, tuple[str, ...], bool]:
    """(strongly typed, builder flags, calibrator) for one precision."""
    v = f"{major}.x"
    if precision == "int8" and opts.legacy_calibrator:
        if major >= 11:
            raise BuildError(LEGACY_REFUSED.format(v=v))
        if traits.qdq:
            raise BuildError("the legacy calibrator calibrates the FP32 model; got a Q/DQ model")
        if not samples:
            raise BuildError("the legacy calibrator needs calibration samples ([models.NAME.calibration])")
        return False, ("INT8", "FP16"), True
    if precision == "int8":
        if not traits.qdq:
            raise BuildError(INT8_NEEDS_QDQ.format(source=source))
        return (True, (), False) if major >= 10 else (False, ("INT8", "FP16"), False)
    if precision == "fp16":
        if major >= 10 and traits.fp16:
            return True, (), False
        if major >= 11:
            raise BuildError(FP16_NEEDS_TYPED_MODEL.format(v=v))
        return False, ("FP16",), False
    if precision == "fp32":
        return major >= 10, (), False
    raise BuildError(f"tensorrt cannot build precision {precision!r}")


DLA_MISSING = (
    "tensorrt.dla_core = {core}, but TensorRT {v} has no DLA support (10.7 was the last 10.x "
    "release with DLA; 11.0 to 11.4.0 have none on Jetson; 11.4.1 brings it back on Jetson AGX "
    "Orin with JetPack 7.2.2 or later; Jetson Thor has no DLA at all). Set dla_core = -1 to run "
    "on the GPU, or use a TensorRT with DLA: 8.5 (JetPack 5), 8.6 (6.0), 10.3 (6.1/6.2)"
)
DLA_DYNAMIC = (
    "DLA needs static shapes: the profile of input {name!r} is min {lo} / opt {opt} / max {hi}. "
    "Give it min = opt = max (one shape), or set dla_core = -1 to run the dynamic model on the GPU"
)


def dla_cores_error(core: int, cores: int, board: str) -> str:
    """A DLA core this device does not have, named with the board it runs on (Orin AGX and NX
    have 2 cores; an Orin Nano, a Jetson Thor and a discrete GPU none)."""
    where = board or "this GPU"
    has = f"only {cores} DLA core(s) (0..{cores - 1})" if cores else "no DLA cores"
    return f"tensorrt.dla_core = {core}, but {where} has {has}: set dla_core = -1 to run on the GPU"


def check_dla(version: Version, dla_core: int, profiles: Mapping[str, tuple[Any, Any, Any]]) -> None:
    """Refuse a DLA build that cannot run on the DLA, naming what to change."""
    if dla_core < 0:
        return
    if not dla_supported(version):
        raise BuildError(DLA_MISSING.format(core=dla_core, v=".".join(map(str, version))))
    for name, (lo, opt, hi) in profiles.items():
        if not tuple(lo) == tuple(opt) == tuple(hi):
            raise BuildError(DLA_DYNAMIC.format(name=name, lo=list(lo), opt=list(opt), hi=list(hi)))


def plan_build(
    version: Version,
    precision: str,
    opts: BuildOptions,
    traits: ModelTraits,
    source: str = "",
    samples: bool = False,
) -> BuildPlan:
    """``samples``: calibration samples come with the build (the legacy calibrator needs them)."""
    reason = unsupported_reason(version)
    if reason:
        raise BuildError(reason)
    major = version[0]
    notes: list[str] = []
    if major > NEWEST_MAJOR:
        notes.append(f"TensorRT {major} is newer than this edged knows; building as for 11")
    if opts.dla_core >= 0 and not dla_supported(version):
        raise BuildError(DLA_MISSING.format(core=opts.dla_core, v=".".join(map(str, version))))
    strongly, flags, calibrator = _precision_plan(major, precision, opts, traits, source, samples)
    if opts.legacy_calibrator and precision != "int8":
        notes.append(f"legacy_calibrator applies to int8 only; ignored for {precision}")
    if calibrator and major == 10:
        notes.append("implicit INT8 calibration is deprecated since TensorRT 10.1 and gone in 11")
    if opts.dla_core >= 0:
        flags += ("GPU_FALLBACK",)
        if precision == "fp32":
            notes.append("DLA runs FP16 and INT8 only: with fp32 every layer falls back to the GPU")
        elif precision == "int8" and not calibrator and major < 11:
            notes.append(
                "DLA on TensorRT 8/10 takes INT8 scales from the calibrator; Q/DQ layers "
                "that DLA cannot run fall back to the GPU (legacy_calibrator = true "
                "calibrates for DLA)"
            )
    level: int | None = opts.builder_optimization_level
    if version < (8, 6, 0):  # the optimisation level arrived in 8.6
        if level != BuildOptions.builder_optimization_level:
            notes.append("builder_optimization_level needs TensorRT 8.6; ignored on 8.5")
        level = None
    if major < 10:
        network_flags: tuple[str, ...] = ("EXPLICIT_BATCH",)
    else:  # 11 types every network strongly and ignores the (deprecated) flag
        network_flags = ("STRONGLY_TYPED",) if strongly and major == 10 else ()
    scheme = profile_scheme(version)
    return BuildPlan(
        network_flags,
        strongly,
        flags,
        calibrator,
        level,
        opts.dla_core,
        tuple(notes),
        preview_features=("PROFILE_SHARING_0806",) if scheme.preview_sharing else (),
        profile_copies=scheme.copies(opts.instances),
        fp16_float_parts=strongly and precision == "int8" and opts.float_parts == "fp16",
        version=version,
    )


def buildable_precisions(version: Version, traits: ModelTraits, opts: BuildOptions) -> tuple[str, ...]:
    """The precisions ``plan_build`` accepts for a model with these traits (its FP32 form: for
    int8 the pipeline writes the Q/DQ model itself, unless the legacy calibrator takes the FP32
    one), in fallback order. On 11.x an FP32 model has no fp16: its chain is int8 -> fp32."""
    found = []
    for precision in ("int8", "fp16", "fp32"):
        probe = replace(traits, qdq=True) if precision == "int8" and not opts.legacy_calibrator else traits
        try:
            plan_build(version, precision, opts, probe, samples=True)
        except BuildError:
            continue
        found.append(precision)
    return tuple(found)
