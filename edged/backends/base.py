"""The backend template.

A backend turns a cached artefact (an optimised ONNX model, a TensorRT engine) into something that
runs tensors. It has two levels because TensorRT has two: the ``Backend`` is loaded once per model
(the deserialised engine, the session's graph), and each ``Instance`` is one concurrent runner
(an execution context with its own stream, or an ONNX Runtime session with its own thread pool).
The public methods check state, names, dtypes and shapes (with edged/wire/validate.py's rules, the one
owner of them; a backend adds only its own bounds through ``_input_bounds``); subclasses implement
only the ``_impl`` parts (the shape of Polygraphy's runners).

Building is a class-level operation because it runs in a child process (edged.quantize.worker) that
imports the backend by name, builds, and exits.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from edged.errors import BackendError, EdgedError
from edged.wire.validate import Bounds, InputRules, rules_of

Progress = Callable[[str, float | None], None]
"""Build progress callback: (phase, fraction done or None when unknown)."""


@dataclass(frozen=True)
class TensorSpec:
    """One input or output: name, numpy dtype name and shape, ``-1`` for a dynamic dimension."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def np_dtype(self) -> np.dtype[Any]:
        return np.dtype(self.dtype)

    def describe(self) -> str:
        dims = ",".join("?" if d < 0 else str(d) for d in self.shape)
        return f"{self.dtype}[{dims}]"


@dataclass(frozen=True)
class BuildSpec:
    """Everything a backend needs to build an artefact; also what the cache key covers."""

    source: str  # the ONNX model to build from (the Q/DQ model for int8)
    precision: str
    profiles: Mapping[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)
    # The calibration part of the samples (an edged.quantize.calibrate.CalibrationSet, read lazily)
    # for a backend that calibrates the FP32 model itself (TensorRT's legacy calibrator); the key
    # covers it through the job's calibration digest.
    calibration: Any = None
    # The engine cache's directory, where a backend keeps what every build on this device shares
    # (TensorRT's timing caches): the artefact's own folder may be a trial's temporary one. "" when
    # the build has no cache (the artefact's folder is used).
    cache_dir: str = ""


@dataclass(frozen=True)
class LoadOptions:
    threads: int = 0  # intra-op threads per instance; 0: the backend decides
    instances: int = 1
    options: Mapping[str, Any] = field(default_factory=dict)


class Instance(abc.ABC):
    """One concurrent runner. Used by exactly one worker thread at a time."""

    def __init__(self, backend: Backend, threads: int = 0) -> None:
        self.backend = backend
        self.threads = threads  # intra-op threads it runs with; 0 where that is not the backend's knob

    def infer(self, inputs: Mapping[str, np.ndarray], checked: bool = False) -> dict[str, np.ndarray]:
        """Run one request. ``checked``: the caller (the service) has already validated the
        inputs against this model, so the second check on the hot path is skipped."""
        if not checked:
            self.backend.check_inputs(inputs)
        try:
            return self._infer_impl(inputs)
        except EdgedError:
            raise  # a request error the backend found (such as text ONNX Runtime cannot take)
        except Exception as e:  # a backend failure is a request error, never a daemon crash
            raise BackendError(f"{self.backend.name} failed to run: {e}") from e

    @abc.abstractmethod
    def _infer_impl(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    # Whether ``infer_into`` runs outputs straight into the caller's arrays (the scheduler binds
    # them only then).
    runs_into: bool = False

    def infer_into(self, inputs: Mapping[str, np.ndarray], into: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one checked request with the outputs named in ``into`` computed straight into those
        arrays (of the shapes and types the run gives them), returned as the results themselves;
        a backend that cannot (``runs_into`` False) runs as ``infer`` and the caller copies.
        Raises, with nothing else changed, when a shape was not the run's (the caller runs
        again without ``into``)."""
        try:
            return self._infer_into_impl(inputs, into)
        except EdgedError:
            raise
        except Exception as e:
            raise BackendError(f"{self.backend.name} failed to run: {e}") from e

    def _infer_into_impl(
        self, inputs: Mapping[str, np.ndarray], into: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        return self._infer_impl(inputs)  # not into them: the caller copies


class Backend(abc.ABC):
    """A model loaded by one backend. Subclasses set ``name`` and implement the ``_impl`` parts."""

    name: ClassVar[str] = "base"
    artifact_suffix: ClassVar[str] = ".bin"
    # Precisions in the order a failed accuracy gate falls back through them.
    precisions: ClassVar[tuple[str, ...]] = ("fp32",)
    # Changed whenever the way this backend builds an artefact changes (a conversion fixed, a
    # recipe retried): it is part of the cache key, so the change reaches artefacts built before.
    build_recipe: ClassVar[str] = "1"

    def __init__(self, artifact: Path, options: LoadOptions | None = None) -> None:
        self.artifact = artifact
        self.options = options or LoadOptions()
        self._lock = threading.Lock()
        self._loaded = False
        self._inputs: tuple[TensorSpec, ...] = ()
        self._outputs: tuple[TensorSpec, ...] = ()
        self._rules = InputRules(())

    # --- class level: availability, identity, building ---

    @classmethod
    @abc.abstractmethod
    def available(cls) -> tuple[bool, str]:
        """(usable here, why or why not); never raises."""

    @classmethod
    @abc.abstractmethod
    def version(cls) -> str: ...

    @classmethod
    @abc.abstractmethod
    def fingerprint(cls) -> dict[str, str]:
        """What an artefact is bound to besides the backend version (device, ISA, driver)."""

    @classmethod
    def device_fingerprint(cls, options: Mapping[str, Any]) -> dict[str, str]:
        """The fingerprint of the device a build with these options runs on (a backend that
        builds on one of several GPUs names that GPU); ``fingerprint()`` unless overridden."""
        return cls.fingerprint()

    @classmethod
    def buildable_precisions(cls, source: str, options: Mapping[str, Any]) -> tuple[str, ...]:
        """The precisions this backend can build for the model at ``source`` with these options
        here, in fallback order (a TensorRT without weak typing cannot build fp16 from an FP32
        model); a failed accuracy gate falls back only through these."""
        return cls.precisions

    @classmethod
    @abc.abstractmethod
    def build(cls, spec: BuildSpec, dest: Path, progress: Progress) -> dict[str, Any]:
        """Write the artefact to ``dest`` (a temporary path); return extra manifest fields."""

    @classmethod
    def stored_precision(cls, path: str) -> str:
        """How the model file stores its weights when the file itself says so (a GGUF's file
        type, such as ``q4_1``); '' when it does not. Shown in status; the build's precision is
        ``effective_precision``'s."""
        return ""

    @classmethod
    def effective_precision(cls, wanted: str) -> tuple[str, str]:
        """(precision this backend will run, reason when it differs from ``wanted``). ``auto``
        stays ``auto`` (the build chooses among ``precisions``) where there is a choice to make."""
        if wanted == "auto" and len(cls.precisions) > 1:
            return "auto", ""
        if wanted in cls.precisions:
            return wanted, ""
        return "fp32", f"{cls.name} has no {wanted} path; running fp32"

    # --- instance level ---

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        return self._inputs

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return self._outputs

    def load(self) -> None:
        with self._lock:
            if self._loaded:
                return
            self._inputs, self._outputs = self._load_impl()
            self._rules = rules_of(self._inputs, self._input_bounds())
            self._loaded = True

    def instance(self, threads: int = 0) -> Instance:
        """A new runner; ``threads``: its intra-op threads, 0 for the configured count (or the
        backend's rule). Only a backend whose ``auto_threads`` is non-zero takes another count."""
        if not self._loaded:
            raise BackendError(f"{self.name}: create_instance before load")
        return self._instance_impl(threads)

    def auto_threads(self) -> int:
        """The intra-op threads this backend gives an instance by its own rule, when the
        configuration leaves the count open and the backend could run with fewer; 0 when there is
        nothing to choose (a count in the configuration, a single core, a backend without the
        knob). The registry may then measure fewer at warm-up (edged/serving/threadpick.py)."""
        return 0

    def unload(self) -> None:
        with self._lock:
            if not self._loaded:
                return
            self._loaded = False
            self._unload_impl()

    def footprint(self) -> int:
        """Bytes this model holds once loaded with its instances (weights, buffers)."""
        return self._footprint_impl()

    @property
    def input_rules(self) -> InputRules:
        """The inputs as edged/wire/validate.py checks them, with this backend's own bounds."""
        return self._rules

    def check_inputs(self, inputs: Mapping[str, np.ndarray]) -> None:
        if not self._loaded:
            raise BackendError(f"{self.name}: model is not loaded")
        self._rules.check(inputs)

    def _input_bounds(self) -> Mapping[str, Bounds]:
        """Shapes this backend cannot run beyond, per input (after ``_load_impl``); none by default."""
        return {}

    @abc.abstractmethod
    def _load_impl(self) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]: ...

    @abc.abstractmethod
    def _instance_impl(self, threads: int) -> Instance: ...

    @abc.abstractmethod
    def _unload_impl(self) -> None: ...

    @abc.abstractmethod
    def _footprint_impl(self) -> int: ...
