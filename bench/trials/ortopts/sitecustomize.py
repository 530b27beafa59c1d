"""Loaded by Python at start-up when this folder is on PYTHONPATH (bench/placement.py puts it there
for one edged daemon): trials of ONNX Runtime session settings without touching edged's code.

BENCH_ORT_SPIN=0          intra-op threads do not spin after a run
BENCH_ORT_THREADS=native  intra_op_num_threads = 0: ONNX Runtime picks the count (physical
                          cores) and pins each pool thread to its own core, as an in-process
                          default session does; edged sets cores / instances, unpinned
"""

from __future__ import annotations

import os
from typing import Any


def _patch() -> None:
    from edged.backends import onnxruntime as backend

    original = backend.OnnxRuntimeBackend._options
    spin = os.environ.get("BENCH_ORT_SPIN", "1")
    native = os.environ.get("BENCH_ORT_THREADS") == "native"

    def options(threads: int) -> Any:
        so = original(0 if native else threads)
        if spin == "0":
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return so

    backend.OnnxRuntimeBackend._options = staticmethod(options)  # type: ignore[method-assign]


_patch()
