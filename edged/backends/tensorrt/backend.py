"""The TensorRT backend: an engine deserialised once, one execution context per instance.

Loading reads the plan, deserialises it with the process's one logger and checks what TensorRT
said: a null engine or a logged error means the plan does not fit this TensorRT or GPU, and the
loader raises ``CacheError`` so the cache quarantines it and the model is rebuilt. Each instance
gets its own execution context, stream and buffers (``cuda.IOBuffers``); inference is the same on
every supported version: ``set_input_shape``, ``set_tensor_address`` (once, buffers never move),
``execute_async_v3`` on the instance's stream.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edged.backends.base import Backend, BuildSpec, Instance, LoadOptions, Progress, TensorSpec
from edged.backends.tensorrt.cuda import CudaDevice, IOBuffers, shared_device
from edged.backends.tensorrt.fingerprint import TEGRA_RELEASE, board_model, gpu_fingerprint, tensorrt_cuda
from edged.backends.tensorrt.profiles import ProfileSlots, profile_scheme, select_profile
from edged.backends.tensorrt.shapes import (
    Profile,
    Shape,
    TensorPlan,
    dims,
    io_bytes,
    is_dynamic,
    max_shape,
    narrow_int64,
    numpy_dtype,
)
from edged.backends.tensorrt.trtlog import capture_errors, get_logger
from edged.backends.tensorrt.versions import (
    BUILD_RECIPE,
    BuildOptions,
    buildable_precisions,
    parse_version,
    read_model_traits,
    unsupported_reason,
    uses_device_memory_v2,
)
from edged.errors import BackendError, CacheError, InvalidInputError
from edged.wire.validate import Bounds

if TYPE_CHECKING:
    import tensorrt as trt

log = logging.getLogger(__name__)


@functools.cache
def _fingerprint(ordinal: int) -> dict[str, str]:
    import tensorrt as trt

    # cu12 and cu13 builds of one TensorRT share a version string; Orin NX 8GB and Orin Nano
    # 8GB report the same GPU: both go into the key. The GPU is the one the engine is built and
    # loaded on (``tensorrt.device``), which on a host with two different GPUs is not GPU 0.
    return {
        "tensorrt": trt.__version__,
        "tensorrt_cuda": tensorrt_cuda(),
        "board": board_model(),
        **gpu_fingerprint(shared_device(ordinal)),
    }


def _jetson_hint() -> str:
    """On a Jetson, TensorRT is there but its bindings may be for another Python (JetPack 5's are
    for 3.8): say what makes them import here."""
    if not Path(TEGRA_RELEASE).exists():
        return ""
    return (
        f"; on a Jetson, scripts/install.sh --python {sys.executable} makes JetPack's TensorRT import under this "
        "Python (JetPack 5: it builds the bindings for it; docs/tensorrt.md#what-it-needs)"
    )


class _TrtInstance(Instance):
    """One execution context with its own stream and buffers; one worker thread at a time."""

    def __init__(
        self,
        backend: TensorRTBackend,
        ctx: trt.IExecutionContext,
        io: IOBuffers,
        outputs: tuple[str, ...],
        profile: int,
    ) -> None:
        super().__init__(backend)
        self._trt = backend  # ``self.backend`` typed as what it is
        self._ctx: trt.IExecutionContext | None = ctx
        self.io = io
        self._outputs = outputs
        self.profile = profile

    def _infer_impl(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        ctx = self._ctx
        if ctx is None:
            raise BackendError("this instance was closed")
        inputs = self._trt.narrowed(inputs)
        with self.io.device.activate():
            for name, arr in inputs.items():
                if not ctx.set_input_shape(name, arr.shape):
                    raise RuntimeError(f"TensorRT refused shape {arr.shape} for {name!r}")
            return self.io.run(inputs, self._enqueue, self._output_shapes)

    def _enqueue(self, stream: int) -> None:
        assert self._ctx is not None
        if not self._ctx.execute_async_v3(stream):
            raise RuntimeError("execute_async_v3 failed; the TensorRT log says why")

    def _output_shapes(self) -> dict[str, Shape]:
        assert self._ctx is not None
        return {name: dims(self._ctx.get_tensor_shape(name)) for name in self._outputs}

    def free(self) -> None:
        """Drop the context and buffers (the caller has the device active)."""
        self.io.free()
        self._ctx = None


class TensorRTBackend(Backend):
    """``LoadOptions.options`` may hold ``device`` (GPU ordinal, 0), ``dla_core`` (the DLA core a
    DLA engine runs on; -1, TensorRT's default, otherwise) and ``mapped`` (force mapped host
    buffers on or off; by default on exactly when the GPU is integrated, as on a Jetson)."""

    name = "tensorrt"
    artifact_suffix = ".engine"
    precisions = ("int8", "fp16", "fp32")
    build_recipe = BUILD_RECIPE

    def __init__(self, artifact: Path, options: LoadOptions | None = None) -> None:
        super().__init__(artifact, options)
        extra = self.options.options
        self._ordinal = int(extra.get("device", 0))
        self._dla_core = int(extra.get("dla_core", -1))
        self._mapped_option: bool | None = extra.get("mapped")
        self._device: CudaDevice | None = None
        self._runtime: trt.Runtime | None = None
        self._engine: trt.ICudaEngine | None = None
        self._spare: trt.IExecutionContext | None = None
        self._plans: tuple[TensorPlan, ...] = ()
        self._profiles: dict[str, Profile] = {}
        self._mapped = False
        self._context_bytes = 0
        self._live: list[_TrtInstance] = []
        self._instances_lock = threading.Lock()
        self._slots: ProfileSlots | None = None
        self._int32_inputs: frozenset[str] = frozenset()

    # --- class level ------------------------------------------------------------------------------

    @classmethod
    def available(cls) -> tuple[bool, str]:
        try:
            import tensorrt as trt

            version = trt.__version__
        except AttributeError:  # a namespace package: only the type stubs are installed
            return False, "tensorrt is not installed (only its type stubs are)" + _jetson_hint()
        except Exception as e:  # ImportError, or a libnvinfer that fails to load
            return False, f"tensorrt does not import ({type(e).__name__}: {e})" + _jetson_hint()
        why = unsupported_reason(parse_version(version))
        if why:
            return False, why
        try:
            device = shared_device(0)
        except Exception as e:  # no pycuda, no driver, no GPU
            return False, f"no usable NVIDIA GPU through pycuda ({type(e).__name__}: {e})"
        return True, f"tensorrt {version} on {device.name}"

    @classmethod
    def version(cls) -> str:
        import tensorrt as trt

        return str(trt.__version__)

    @classmethod
    def profiles_per_engine(cls, instances: int) -> int:
        """Identical optimization profiles a dynamic engine needs for ``instances`` contexts on the
        installed TensorRT (8.5: one each; later versions share one)."""
        return profile_scheme(parse_version(cls.version())).copies(instances)

    @classmethod
    def fingerprint(cls) -> dict[str, str]:
        """GPU 0's; a build or a cache key names its own GPU through ``device_fingerprint``."""
        return dict(_fingerprint(0))

    @classmethod
    def device_fingerprint(cls, options: Mapping[str, Any]) -> dict[str, str]:
        return dict(_fingerprint(BuildOptions.from_mapping(options).device))

    @classmethod
    def buildable_precisions(cls, source: str, options: Mapping[str, Any]) -> tuple[str, ...]:
        """What ``plan_build`` accepts for this model on the installed TensorRT: on 11.x an FP32
        model has no fp16 (no FP16 flag; only an FP16 model builds fp16), so int8 falls back to fp32."""
        version = parse_version(cls.version())
        return buildable_precisions(version, read_model_traits(source), BuildOptions.from_mapping(options))

    @classmethod
    def build(cls, spec: BuildSpec, dest: Path, progress: Progress) -> dict[str, Any]:
        from edged.backends.tensorrt.build import build_engine

        # On the GPU the model will be loaded on: an engine is tuned for (and on a multi-GPU
        # host may only load on) the device that built it.
        with shared_device(BuildOptions.from_mapping(spec.options).device).activate():
            return build_engine(spec, dest, progress, cls.device_fingerprint(spec.options))

    # --- loading --------------------------------------------------------------------------------

    def _load_impl(self) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
        import tensorrt as trt

        try:
            data = self.artifact.read_bytes()
        except OSError as e:
            raise CacheError(f"{self.artifact.name}: cannot read the engine: {e}") from e
        device = shared_device(self._ordinal)
        with device.activate():
            runtime, engine = self._deserialize(data)
            specs, profiles = _io_specs(engine)
            ctx = engine.create_execution_context()
            if ctx is None:
                raise BackendError(f"{self.artifact.name}: no execution context (device memory?)")
            plans = _buffer_plans(ctx, specs, profiles)
        self._device, self._runtime, self._engine, self._spare = device, runtime, engine, ctx
        self._plans, self._profiles = plans, profiles
        self._int32_inputs = frozenset(p.name for p in plans if p.is_input and p.dtype == "int32")
        version = parse_version(trt.__version__)
        self._slots = ProfileSlots(
            profile_scheme(version), engine.num_optimization_profiles, bool(profiles), self.artifact.name
        )
        self._mapped = device.integrated and device.can_map if self._mapped_option is None else self._mapped_option
        self._context_bytes = (
            engine.device_memory_size_v2 if uses_device_memory_v2(version) else engine.device_memory_size
        )
        log.info(
            "loaded %s: %d I/O tensors, %d bytes of activations per context%s",
            self.artifact.name,
            len(specs),
            self._context_bytes,
            ", mapped host buffers" if self._mapped else "",
        )
        inputs = tuple(s for s, is_in in specs if is_in)
        return inputs, tuple(s for s, is_in in specs if not is_in)

    def _deserialize(self, data: bytes) -> tuple[trt.Runtime, trt.ICudaEngine]:
        import tensorrt as trt

        runtime = trt.Runtime(get_logger())
        if self._dla_core >= 0:
            runtime.DLA_core = self._dla_core
        name = self.artifact.name
        with capture_errors() as errors:
            try:
                engine = runtime.deserialize_cuda_engine(data)
            except Exception as e:  # some versions raise instead of returning null
                raise CacheError(f"{name}: TensorRT cannot deserialise it ({e}); rebuild") from e
        if engine is None or errors:
            why = "; ".join(errors) or "it returned no engine"
            raise CacheError(f"{name}: TensorRT rejected the engine ({why}); rebuild")
        return runtime, engine

    def check_inputs(self, inputs: Mapping[str, np.ndarray]) -> None:
        """The shared rules (edged/wire/validate.py), on the INT32 a direct caller's INT64 becomes."""
        super().check_inputs(self.narrowed(inputs))

    def _input_bounds(self) -> Mapping[str, Bounds]:
        """A dynamic input's profile: TensorRT refuses a shape outside it."""
        return {name: (lo, hi) for name, (lo, _, hi) in self._profiles.items()}

    def narrowed(self, inputs: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        """INT64 arrays for the inputs TensorRT 8.x made INT32, as INT32 (range-checked): what a
        direct caller holds for such a model (the build's accuracy gate feeds the ONNX model's
        INT64). The wire takes the engine's INT32, as the model's metadata says."""
        if not self._int32_inputs or not any(
            arr.dtype == np.int64 and name in self._int32_inputs for name, arr in inputs.items()
        ):
            return inputs
        try:
            return {
                name: narrow_int64(name, arr) if arr.dtype == np.int64 and name in self._int32_inputs else arr
                for name, arr in inputs.items()
            }
        except ValueError as e:
            raise InvalidInputError(str(e)) from None

    # --- instances ------------------------------------------------------------------------------

    def _instance_impl(self, threads: int) -> Instance:
        # ``threads`` is 0 here: an engine's kernels run on the GPU, there is no CPU pool to size.
        device, engine, slots = self._device, self._engine, self._slots
        assert device is not None and engine is not None and slots is not None
        with self._instances_lock:
            # Together, so the engine's first context (made at load, on profile 0 already) is the
            # one that gets profile 0: with them apart, two threads could cross and one context
            # ask for profile 0 while the first still holds it (TensorRT 8.5 refuses that).
            index = slots.acquire()  # raises when TensorRT 8.5 has no profile left for a context
            ctx, self._spare = self._spare, None
        first = ctx is not None
        try:
            with device.activate():
                if ctx is None:
                    ctx = engine.create_execution_context()
                    if ctx is None:
                        raise BackendError(f"{self.artifact.name}: no execution context (out of device memory?)")
                io = IOBuffers(device, self._plans, mapped=self._mapped)
                try:
                    select_profile(ctx, slots, index, first, io.stream_handle, io.synchronize)
                    for plan in self._plans:
                        if not ctx.set_tensor_address(plan.name, io.address(plan.name)):
                            raise BackendError(f"TensorRT refused the buffer of {plan.name!r}")
                except BaseException:
                    io.free()
                    raise
        except BaseException:
            slots.release(index)
            raise
        outputs = tuple(p.name for p in self._plans if not p.is_input)
        inst = _TrtInstance(self, ctx, io, outputs, index)
        with self._instances_lock:
            self._live.append(inst)
        return inst

    def _unload_impl(self) -> None:
        with self._instances_lock:
            live, self._live = self._live, []
            spare, self._spare = self._spare, None
        if self._device is None:
            return
        # Contexts before the engine, the engine before the runtime (TensorRT's order), all
        # with the context current so their device memory goes back now.
        with self._device.activate():
            for inst in live:
                inst.free()
            del spare
            self._engine = None
            self._runtime = None
        self._slots = None

    def _footprint_impl(self) -> int:
        try:
            weights = self.artifact.stat().st_size  # the plan is the weights plus a little
        except OSError:
            weights = 0
        if not self._loaded:
            return weights
        per_instance = self._context_bytes + io_bytes(self._plans, self._mapped)
        return weights + max(self.options.instances, len(self._live)) * per_instance


IOSpec = tuple[TensorSpec, bool]  # spec, is input


def _io_specs(engine: trt.ICudaEngine) -> tuple[list[IOSpec], dict[str, Profile]]:
    """The engine's I/O tensors in its order, and profile 0's shapes for dynamic inputs."""
    import tensorrt as trt

    specs: list[IOSpec] = []
    profiles: dict[str, Profile] = {}
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
        if engine.get_tensor_location(name) != trt.TensorLocation.DEVICE:
            raise BackendError(
                f"tensor {name!r} lives on the host (a shape tensor); edged runs engines whose I/O is on the device"
            )
        if engine.get_tensor_format(name) != trt.TensorFormat.LINEAR:
            raise BackendError(f"tensor {name!r} is not in linear layout")
        try:
            dtype = numpy_dtype(engine.get_tensor_dtype(name).name, name)
        except ValueError as e:
            raise BackendError(str(e)) from None
        shape = dims(engine.get_tensor_shape(name))
        if is_input and is_dynamic(shape):
            lo, opt, hi = (dims(d) for d in engine.get_tensor_profile_shape(name, 0))
            profiles[name] = (lo, opt, hi)
        specs.append((TensorSpec(name, dtype, shape), is_input))
    return specs, profiles


def _buffer_plans(
    ctx: trt.IExecutionContext, specs: list[IOSpec], profiles: Mapping[str, Profile]
) -> tuple[TensorPlan, ...]:
    """Buffer sizes: inputs at their profile's maximum, outputs at the shapes TensorRT infers
    from those maxima (so one allocation serves every request)."""
    plans = []
    try:
        for spec, is_input in specs:
            if is_input:
                prof = profiles.get(spec.name)
                biggest = max_shape(spec.name, spec.shape, prof[2] if prof else None)
                if not ctx.set_input_shape(spec.name, biggest):
                    raise ValueError(f"TensorRT refused {biggest} for input {spec.name!r}")
                plans.append(TensorPlan(spec.name, spec.dtype, biggest, True))
        for spec, is_input in specs:
            if not is_input:
                inferred = dims(ctx.get_tensor_shape(spec.name))
                plans.append(TensorPlan(spec.name, spec.dtype, max_shape(spec.name, inferred, None), False))
    except ValueError as e:
        raise BackendError(str(e)) from None
    return tuple(plans)
