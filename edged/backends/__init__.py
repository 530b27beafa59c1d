"""Backends by name, imported lazily.

Only the module of the backend in use is imported, so the daemon starts without TensorRT or pycuda
and never pays for an import it does not need (the table-of-import-paths idea of uvicorn's
``config.py``). ``auto`` picks TensorRT where it imports and sees a GPU, ONNX Runtime otherwise.
"""

from __future__ import annotations

import importlib
import logging

from edged.backends.base import Backend
from edged.errors import BackendUnavailableError

log = logging.getLogger(__name__)

BACKENDS: dict[str, str] = {
    "onnxruntime": "edged.backends.onnxruntime:OnnxRuntimeBackend",
    "tensorrt": "edged.backends.tensorrt:TensorRTBackend",
    "llama": "edged.backends.llama:LlamaBackend",
}
# Model files that only a generation backend reads: ``auto`` picks it by the file's suffix.
_GENERATIVE_SUFFIXES = {".gguf": "llama"}
_AUTO_ORDER = ("tensorrt", "onnxruntime")
_resolved: dict[str, type[Backend]] = {}


def backend_class(name: str) -> type[Backend]:
    """Import and return the backend class registered under ``name``."""
    if name in _resolved:
        return _resolved[name]
    try:
        target = BACKENDS[name]
    except KeyError:
        raise BackendUnavailableError(f"unknown backend {name!r}") from None
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise BackendUnavailableError(f"backend {name!r} cannot be imported: {e}") from e
    cls: type[Backend] = getattr(module, attr)
    _resolved[name] = cls
    return cls


def _available(cls: type[Backend]) -> tuple[bool, str]:
    try:
        return cls.available()
    except Exception as e:  # a half-installed library must not take the daemon down
        return False, f"availability check failed: {e.__class__.__name__}: {e}"


def generative_backend(path: str) -> str | None:
    """The generation backend that serves a model file of this kind (a GGUF), if any."""
    for suffix, backend in _GENERATIVE_SUFFIXES.items():
        if path.lower().endswith(suffix):
            return backend
    return None


def resolve(name: str, path: str = "") -> tuple[type[Backend], str]:
    """(backend class, why it was chosen) for a config's ``backend`` value and model file."""
    generative = generative_backend(path)
    if name == "auto" and generative is not None:
        cls = backend_class(generative)
        ok, why = _available(cls)
        if not ok:
            raise BackendUnavailableError(f"backend {generative!r} (for {path}) is not usable here: {why}")
        return cls, f"auto: {generative} for a GGUF model ({why})"
    if name != "auto":
        cls = backend_class(name)
        ok, why = _available(cls)
        if not ok:
            raise BackendUnavailableError(f"backend {name!r} is not usable here: {why}")
        return cls, "configured"
    reasons = []
    for candidate in _AUTO_ORDER:
        try:
            cls = backend_class(candidate)
        except BackendUnavailableError as e:
            reasons.append(str(e))
            continue
        ok, why = _available(cls)
        if ok:
            return cls, f"auto: {candidate} ({why})" + (f"; skipped: {'; '.join(reasons)}" if reasons else "")
        reasons.append(f"{candidate}: {why}")
    raise BackendUnavailableError("no backend is usable: " + "; ".join(reasons))
