"""ONNX Runtime on the CPU: the backend every Linux machine has, and the accuracy reference.

The cached artefact is the model as ONNX Runtime optimises it for this machine (level ALL, which
may use kernels of this CPU's ISA: hence the CPU model and flags in the cache key). Loading it
again skips the optimiser, which is most of a session's start-up time.
"""

from __future__ import annotations

import hashlib
import os
import platform
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from edged.backends.base import Backend, BuildSpec, Instance, Progress, TensorSpec
from edged.errors import InvalidInputError

# ONNX Runtime's own telemetry is off: the daemon writes nothing it was not asked to.
ort.disable_telemetry_events()

# Session config for every session. On x86 CPUs without VNNI (AVX2 only, or AVX-512 before
# Cascade Lake) ORT's default U8S8 int8 kernels add pairs of u8 x s8 products in saturating int16
# (vpmaddubsw): full-range int8 weights overflow and a Q/DQ model's answers go wrong (relative L2
# error 0.32 instead of 0.006 on the unit tests' small net). Precision mode makes the optimiser
# convert the weights to u8 for the U8U8 kernels, which do not saturate, only where the CPU would
# overflow; VNNI and ARM CPUs are left as they are. The optimiser bakes this into the artefact,
# so version() puts it in the cache key.
SESSION_CONFIG = {"session.x64quantprecision": "1"}


# Options of a serving session only (not of the optimiser, so not in the cache key). The intra-op
# pool's threads spin while a run is in progress (its parallel sections start without a wake-up)
# but stop when the run returns: left spinning, a pool as wide as the machine kept every core busy
# just as the worker handed the answer back, and the event loop's wake-up waited for a scheduler
# tick (2.5-4.4 ms per request on a 16-core host, bench first-request --stages).
SERVING_CONFIG = {"session.force_spinning_stop": "1"}


def _configure(so: ort.SessionOptions) -> ort.SessionOptions:
    for key, value in SESSION_CONFIG.items():
        so.add_session_config_entry(key, value)
    return so


_ORT_TYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(double)": "float64",
    "tensor(int8)": "int8",
    "tensor(uint8)": "uint8",
    "tensor(int16)": "int16",
    "tensor(uint16)": "uint16",
    "tensor(int32)": "int32",
    "tensor(uint32)": "uint32",
    "tensor(int64)": "int64",
    "tensor(uint64)": "uint64",
    "tensor(bool)": "bool",
    "tensor(string)": "object",  # BYTES: object arrays (of str for ONNX Runtime, of bytes in edged)
}


def _cpu_info() -> dict[str, str]:
    model, flags = platform.processor() or platform.machine(), ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model", "CPU part") and model in ("", platform.machine()):
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = value.strip()
    except OSError:
        pass
    return {
        "arch": platform.machine(),
        "cpu": model,
        "isa": hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:16],
    }


@cache
def _fingerprint() -> dict[str, str]:
    return _cpu_info()


def _spec(node: Any) -> TensorSpec:
    dtype = _ORT_TYPES.get(node.type)
    if dtype is None:
        raise TypeError(f"tensor {node.name!r} has unsupported type {node.type}")
    shape = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in node.shape)
    return TensorSpec(node.name, dtype, shape)


def ort_session(path: str, threads: int = 0) -> ort.InferenceSession:
    """A plain CPU session (the reference for accuracy gates and calibration)."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    return ort.InferenceSession(path, _configure(so), providers=["CPUExecutionProvider"])


def _to_text(name: str, arr: np.ndarray) -> np.ndarray:
    """ONNX Runtime's Python binding takes str elements for a string tensor (a bytes element would
    become its repr, "b'..'"): edged's bytes are decoded as UTF-8, the text ONNX strings hold."""
    out = np.empty(arr.shape, dtype=object)
    flat = out.reshape(-1)
    for i, value in enumerate(arr.reshape(-1).tolist()):
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError:
                raise InvalidInputError(
                    f"input '{name}': BYTES element {i} is not UTF-8, which ONNX Runtime's strings must be"
                ) from None
        flat[i] = value
    return out


def _to_bytes(arr: np.ndarray) -> np.ndarray:
    out = np.empty(arr.shape, dtype=object)
    flat = out.reshape(-1)
    for i, value in enumerate(arr.reshape(-1).tolist()):
        flat[i] = value.encode("utf-8") if isinstance(value, str) else value
    return out


# A run into a caller's arrays whose guessed shape missed fails, and is run again plainly: the
# scheduler logs it once; ONNX Runtime would print its own error line on stderr every time.
_QUIET = ort.RunOptions()
_QUIET.log_severity_level = 4


class _OrtInstance(Instance):
    runs_into = True

    def __init__(self, backend: OnnxRuntimeBackend, session: ort.InferenceSession, threads: int) -> None:
        super().__init__(backend, threads)
        self._session = session
        # The session's compiled run, without InferenceSession.run's Python checks (input names
        # against the graph, OrtValue ownership, WebGPU graph capture, a fallback to other
        # providers): Service has already checked the names, shapes and types, the feed holds
        # numpy arrays only and the session has the CPU provider alone. 2.6% of the event loop's
        # time at c=1 for the tiny model (py-spy). ``_sess`` is the wrapper's own attribute: an
        # onnxruntime without it gets the public run.
        self._run = getattr(session, "_sess", session).run
        self._names = [o.name for o in backend.outputs]
        self._text_in = frozenset(s.name for s in backend.inputs if s.dtype == "object")
        self._text_out = frozenset(s.name for s in backend.outputs if s.dtype == "object")

    def _infer_into_impl(
        self, inputs: Mapping[str, np.ndarray], into: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        if self._text_in or self._text_out:
            return self._infer_impl(inputs)  # strings are converted: nothing to bind
        # ONNX Runtime's I/O binding: a bound output's last kernel writes into the array itself.
        binding = self._session.io_binding()
        for name, arr in inputs.items():
            binding.bind_cpu_input(name, arr)
        for name in self._names:
            dest = into.get(name)
            if dest is None:
                binding.bind_output(name, "cpu")
            else:
                binding.bind_output(name, "cpu", 0, dest.dtype, list(dest.shape), dest.ctypes.data)
        self._session.run_with_iobinding(binding, _QUIET)
        values = binding.get_outputs()
        # An output that is also an input (passed through) is handed back where the input lies,
        # the bound array untouched: such a one is returned as ONNX Runtime gives it, and copied.
        return {
            name: into[name] if name in into and values[i].data_ptr() == into[name].ctypes.data else values[i].numpy()
            for i, name in enumerate(self._names)
        }

    def _infer_impl(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        feed = dict(inputs)
        for name in self._text_in:
            feed[name] = _to_text(name, feed[name])
        results = dict(zip(self._names, self._run(self._names, feed, None)))
        for name in self._text_out:
            results[name] = _to_bytes(results[name])
        return results


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"
    artifact_suffix = ".onnx"
    precisions = ("int8", "fp32")

    def __init__(self, artifact: Path, options: Any = None) -> None:
        super().__init__(artifact, options)
        # The session load() made (to read the specs), handed to the first instance and then
        # dropped here: an instance the warm-up replaces (fewer threads) frees its session.
        self._first: ort.InferenceSession | None = None

    @staticmethod
    def specs_of(sess: ort.InferenceSession) -> tuple[TensorSpec, ...]:
        return tuple(_spec(i) for i in sess.get_inputs())

    @classmethod
    def available(cls) -> tuple[bool, str]:
        return True, f"onnxruntime {ort.__version__} on the CPU"

    @classmethod
    def version(cls) -> str:
        config = ",".join(f"{k}={v}" for k, v in sorted(SESSION_CONFIG.items()))
        return f"{ort.__version__} ({config})"

    @classmethod
    def fingerprint(cls) -> dict[str, str]:
        return dict(_fingerprint())

    @classmethod
    def effective_precision(cls, wanted: str) -> tuple[str, str]:
        if wanted == "fp16":
            return "fp32", "onnxruntime on the CPU has no fp16 kernels that pay; running fp32"
        return super().effective_precision(wanted)

    @classmethod
    def build(cls, spec: BuildSpec, dest: Path, progress: Progress) -> dict[str, Any]:
        progress("optimizing", None)
        so = cls._options(threads=1)
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.optimized_model_filepath = str(dest)
        ort.InferenceSession(spec.source, so, providers=["CPUExecutionProvider"])
        progress("optimizing", 1.0)
        return {}

    @staticmethod
    def _options(threads: int) -> ort.SessionOptions:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        return _configure(so)

    def _threads(self) -> int:
        if self.options.threads:
            return self.options.threads
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        return max(1, cores // max(1, self.options.instances))

    def auto_threads(self) -> int:
        return 0 if self.options.threads or self._threads() == 1 else self._threads()

    def _session(self, threads: int) -> ort.InferenceSession:
        so = self._options(threads)
        for key, value in SERVING_CONFIG.items():
            so.add_session_config_entry(key, value)
        # The artefact is already optimised for this CPU: running the optimiser again only
        # lengthens the cold start.
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        return ort.InferenceSession(str(self.artifact), so, providers=["CPUExecutionProvider"])

    def _load_impl(self) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
        sess = self._session(self._threads())
        self._first = sess
        return (
            tuple(_spec(i) for i in sess.get_inputs()),
            tuple(_spec(o) for o in sess.get_outputs()),
        )

    def _instance_impl(self, threads: int) -> Instance:
        default = self._threads()
        threads = threads or default
        first = None
        if threads == default:
            with self._lock:
                first, self._first = self._first, None
        return _OrtInstance(self, first if first is not None else self._session(threads), threads)

    def _unload_impl(self) -> None:
        self._first = None

    def _footprint_impl(self) -> int:
        # ONNX Runtime does not report its arena; the registry measures resident memory instead.
        return 0
