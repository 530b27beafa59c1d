"""Triton's answers that its tools read, for every transport: statistics, model configuration
and log settings, as Triton's JSON documents (server docs/protocol/extension_*.md).

HTTP sends them as they are (transports/http/triton.py); gRPC reads the same documents into
grpc_service.proto's messages, whose field names they use. None of them blocks the loop.
"""

from __future__ import annotations

import logging
from typing import Any

from edged.errors import BadRequestError, ModelNotReadyError
from edged.serving.registry import ModelRuntime
from edged.serving.service import Service
from edged.serving.versions import served_config
from edged.wire.tensors import v2_datatype

log = logging.getLogger(__name__)

CUDA_SHM_NOT_SUPPORTED = (
    "CUDA shared memory is not supported: edged's backends read inputs from host memory. "
    "On Jetson, CPU and GPU share the same memory: register a POSIX region with the system "
    "shared memory extension (/v2/systemsharedmemory) instead"
)

# Triton's platform names for the backends it shares with edged; any other backend is named by
# its backend field alone, as Triton does for backends without a platform.
_PLATFORMS = {"onnxruntime": "onnxruntime_onnx", "tensorrt": "tensorrt_plan"}


# --- statistics ----------------------------------------------------------------------------------


def statistics(service: Service, name: str | None) -> dict[str, Any]:
    """Triton's statistics of every configured model, or of one (an unknown model: not found)."""
    if name is not None:
        service.model(name)
    return service.stats.report(name)


# --- model configuration -------------------------------------------------------------------------


def model_config(service: Service, name: str) -> dict[str, Any]:
    """Triton's model configuration, derived from edged's config and the loaded model's tensors
    (a model not loaded has no known tensors: model_not_ready, as its metadata)."""
    rt = service.model(name)
    if rt.backend is None:
        raise ModelNotReadyError(f"model '{name}' is {rt.state}" + (f": {rt.reason}" if rt.reason else ""))
    doc = config_doc(rt)
    origin = service.registry.cfg.repository.get(name)
    if origin is not None:  # a repository model: as its config.pbtxt told clients
        versions = list(service.versions().of.get(origin.model, {origin.version: name}))
        doc = served_config(doc, origin, rt.cfg.max_batch, versions)
    return doc


def config_doc(rt: ModelRuntime) -> dict[str, Any]:
    backend = rt.backend_cls.name if rt.backend_cls else ""
    # Triton's max_batch_size > 0 says the first dimension is a batch that the server may form
    # from several requests, and leaves it out of dims; edged does that only for a model whose
    # queue batches (max_batch > 1 and every input's first axis dynamic). Any other model says
    # 0 and lists every dimension, which is exactly the shape a client sends.
    batching = rt.queue is not None and rt.queue.max_batch > 1
    skip = 1 if batching else 0
    doc: dict[str, Any] = {
        "name": rt.name,
        "platform": _PLATFORMS.get(backend, ""),
        "backend": backend,
        "version_policy": {"latest": {"num_versions": 1}},
        "max_batch_size": rt.queue.max_batch if batching and rt.queue else 0,
        "input": [
            {
                "name": s.name,
                "data_type": _data_type(s.dtype),
                "format": "FORMAT_NONE",
                "dims": list(s.shape[skip:]),
                "is_shape_tensor": False,
                "allow_ragged_batch": False,
                "optional": False,
            }
            for s in rt.inputs
        ],
        "output": [
            {
                "name": s.name,
                "data_type": _data_type(s.dtype),
                "dims": list(s.shape[skip:]),
                "label_filename": "",
                "is_shape_tensor": False,
            }
            for s in rt.outputs
        ],
        "instance_group": [_instance_group(rt, backend)],
    }
    if batching:
        # edged's batcher runs as soon as a preferred size (models.*.preferred_batch) or
        # max_batch rows are queued, or the delay has passed: Triton's dynamic batcher.
        doc["dynamic_batching"] = {
            "preferred_batch_size": list(rt.cfg.preferred_batch),
            "max_queue_delay_microseconds": rt.cfg.max_queue_delay_us,
            "preserve_ordering": False,
        }
    return doc


def _data_type(dtype: str) -> str:
    v2 = v2_datatype(dtype)
    return "TYPE_STRING" if v2 == "BYTES" else f"TYPE_{v2}"


def _instance_group(rt: ModelRuntime, backend: str) -> dict[str, Any]:
    # Where the instances run: a TensorRT engine on its GPU; ONNX Runtime on the CPU (edged
    # loads it with the CPU provider only); llama.cpp on the GPU when it was built with offload.
    gpu = backend == "tensorrt"
    if backend == "llama" and rt.backend_cls is not None:
        gpu = rt.backend_cls.fingerprint().get("gpu_offload") == "True"
    group: dict[str, Any] = {
        "name": f"{rt.name}_0",
        "kind": "KIND_GPU" if gpu else "KIND_CPU",
        "count": rt.cfg.instances,
    }
    group["gpus"] = [rt.cfg.tensorrt.device] if gpu else []
    return group


# --- logging -------------------------------------------------------------------------------------

# Triton's switches from the most severe down, and the Python level that opens each. edged's log
# is one threshold on the "edged" logger: opening a switch opens the more severe ones too.
_SWITCHES = ("log_error", "log_warning", "log_info", "log_verbose_level")
_LEVELS = (logging.CRITICAL, logging.ERROR, logging.WARNING, logging.INFO, logging.DEBUG)
_KEYS = {*_SWITCHES, "log_file", "log_format"}
_FORMAT = "default"  # Triton's name for its usual format; edged's lines are fixed (journald adds time)


def _logger() -> logging.Logger:
    return logging.getLogger("edged")


def _opened() -> int:
    """How many of _SWITCHES are on now (0: only critical messages)."""
    level = _logger().getEffectiveLevel()
    return sum(1 for threshold in _LEVELS[1:] if level <= threshold)


def log_settings() -> dict[str, Any]:
    opened = _opened()
    return {
        "log_file": "",
        "log_info": opened >= 3,
        "log_warning": opened >= 2,
        "log_error": opened >= 1,
        "log_verbose_level": 1 if opened >= 4 else 0,
        "log_format": _FORMAT,
    }


def update_log_settings(doc: dict[str, Any], via: str = "/v2/logging") -> dict[str, Any]:
    """Any subset of the settings (``POST /v2/logging``, gRPC's LogSettings): the switches given
    decide the threshold, the others follow them (turning info off turns verbose off); a
    combination one threshold cannot express, an unknown key or a wrong type is bad_request
    and changes nothing."""
    _check_settings(doc)
    low, high = 0, len(_SWITCHES)  # how many switches may be on
    for i, key in enumerate(_SWITCHES):
        if key in doc:
            on = doc[key] > 0 if key == "log_verbose_level" else doc[key]
            low, high = (max(low, i + 1), high) if on else (low, min(high, i))
    if low > high:
        given = ", ".join(f"{k}={doc[k]}" for k in _SWITCHES if k in doc)
        raise BadRequestError(
            f"edged's log has one threshold (error > warning > info > verbose): {given} cannot be combined"
        )
    opened = min(max(_opened(), low), high)
    level = _LEVELS[opened]
    if _logger().getEffectiveLevel() != level:
        log.warning("log level set to %s through %s", logging.getLevelName(level), via)
        _logger().setLevel(level)
    return log_settings()


def _check_settings(doc: dict[str, Any]) -> None:
    unknown = sorted(set(doc) - _KEYS)
    if unknown:
        raise BadRequestError(f"unknown log settings {unknown}; known: {sorted(_KEYS)}")
    for key, value in doc.items():
        if key == "log_verbose_level":
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise BadRequestError(f"'log_verbose_level' must be a non-negative integer, got {value!r}")
        elif key in _SWITCHES and not isinstance(value, bool):
            raise BadRequestError(f"'{key}' must be true or false, got {value!r}")
    if doc.get("log_file", "") != "":
        raise BadRequestError("'log_file' cannot be set: edged logs to the journal (or stderr), never to a file")
    if doc.get("log_format", _FORMAT) != _FORMAT:
        raise BadRequestError(f"'log_format' cannot be changed: edged's format is {_FORMAT!r}")
