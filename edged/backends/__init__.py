"""Backends by name, imported lazily.

Only the module of the backend in use is imported, so the daemon starts without TensorRT or pycuda
and never pays for an import it does not need (the table-of-import-paths idea of uvicorn's
``config.py``). ``auto`` picks TensorRT where it imports and sees a GPU, ONNX Runtime otherwise.

A backend whose library may be installed after the daemon started (``LATE_LIBRARIES``) is found
then without a restart: ``library_files`` drops the import system's caches before it looks, and
an import that failed leaves nothing cached here, so the next one tries again.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os

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
# Backends whose library may arrive while the daemon runs: backend -> (the top-level module its
# edged module imports, the package that provides it). llama-cpp-python compiles llama.cpp from
# source for minutes (scripts/demo.sh installs it in the background), so a model on it waits for
# it (edged/serving/waiting.py) rather than failing. TensorRT is not here: JetPack installs it
# with the system, and a machine without it is not one where it is about to appear.
LATE_LIBRARIES: dict[str, tuple[str, str]] = {"llama": ("llama_cpp", "llama-cpp-python")}

# What the import system finds for a module: (path, size, mtime in ns) of each of its files.
Files = tuple[tuple[str, int, int], ...]


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


def chosen(name: str, path: str = "") -> str | None:
    """The backend a config's ``backend`` value settles on for a model file without trying any:
    the name itself, or the generation backend of a GGUF under ``auto``; None for ``auto`` on
    other files (the candidates are tried in order then)."""
    return generative_backend(path) if name == "auto" else name


def late_library(name: str, path: str = "") -> tuple[str, str, str] | None:
    """(backend, module, package) when the backend this config settles on is one whose library
    may be installed later and has not imported in this process yet; None otherwise."""
    backend = chosen(name, path)
    if backend is None or backend in _resolved or backend not in LATE_LIBRARIES:
        return None
    module, package = LATE_LIBRARIES[backend]
    return backend, module, package


def waiting_for(name: str, path: str = "") -> tuple[str, str] | None:
    """(backend, why) when the backend this config settles on must be waited for: its library
    may be installed later, and the import system does not find it, or it does not import yet
    (pip may still be writing it; the import is tried again once its files change); None when
    there is nothing to wait for (it resolves, or fails, as usual). Blocking (it lists
    directories on sys.path and may import the backend): a thread's job."""
    late = late_library(name, path)
    if late is None:
        return None
    backend, module, _ = late
    if library_files(module) is None:
        return backend, not_installed_text(backend)
    try:
        backend_class(backend)
    except BackendUnavailableError as e:  # a known backend: its import failed
        return backend, e.message
    return None


def not_installed_text(backend: str) -> str:
    module, package = LATE_LIBRARIES[backend]
    return f"backend {backend} is not installed yet: {module} (from {package}) is not importable"


def library_files(module: str) -> Files | None:
    """The files the import system finds now for the top-level ``module``, with their sizes and
    modification times (a package that pip is still writing changes between two calls); None when
    it finds none. The finders' caches are dropped first: a directory's listing is kept until its
    modification time moves (a write within the clock's tick is missed) and a sys.path entry
    missing at start is remembered as missing. The daemon's own environment (the venv's
    site-packages) is on sys.path from start, so a package installed into it is found; a user site
    directory created after start is not (``site`` adds it at start only if it exists)."""
    importlib.invalidate_caches()
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):  # ValueError: a half-imported module left without a spec
        return None
    if spec is None:
        return None
    roots = list(spec.submodule_search_locations or ()) or ([spec.origin] if spec.origin else [])
    found: list[tuple[str, int, int]] = []
    for root in roots:
        if os.path.isfile(root):
            found.append(_stat(root))
            continue
        for folder, dirs, names in os.walk(root):
            # Bytecode is written by whoever imports first (this daemon too): not the install.
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            found += [_stat(os.path.join(folder, n)) for n in names]
    return tuple(sorted(f for f in found if f[0]))


def _stat(path: str) -> tuple[str, int, int]:
    try:
        st = os.stat(path)
    except OSError:  # removed between the listing and the stat: still changing
        return ("", 0, 0)
    return (path, st.st_size, st.st_mtime_ns)
