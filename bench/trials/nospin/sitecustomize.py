"""Loaded by Python at start-up when this folder is on PYTHONPATH (bench/spinning.py puts
it there for one edged daemon): ONNX Runtime sessions that edged creates get
``session.intra_op.allow_spinning = 0``. A trial of a one-line change to
edged/backends/onnxruntime.py, made without touching that file."""

from __future__ import annotations

from typing import Any


def _patch() -> None:
    from edged.backends import onnxruntime as backend

    original = backend.OnnxRuntimeBackend._options

    def options(threads: int) -> Any:
        so = original(threads)
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return so

    backend.OnnxRuntimeBackend._options = staticmethod(options)  # type: ignore[method-assign]


_patch()
