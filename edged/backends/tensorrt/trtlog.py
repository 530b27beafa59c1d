"""TensorRT's logger, bridged into ``logging``, and the error capture that turns a bad engine into
a rebuild.

TensorRT reports a plan built by another version or for another GPU by logging an error and
returning a null engine; some failures only log. ``capture_errors`` collects the errors TensorRT
logs on the calling thread while a block runs, so the loader can treat any of them as "rebuild".
One logger serves the whole process: TensorRT wants the builder and runtime to share one.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tensorrt as trt

log = logging.getLogger("edged.backends.tensorrt.trt")

# ILogger.Severity values (stable since TensorRT 5): INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE.
# TensorRT's INFO lines are memory-usage chatter, so they go to DEBUG and the journal stays calm.
_LEVELS = {0: logging.CRITICAL, 1: logging.ERROR, 2: logging.WARNING, 3: logging.DEBUG, 4: logging.DEBUG}
_ERROR_SEVERITY = 1

_local = threading.local()
_lock = threading.Lock()
_logger: trt.ILogger | None = None


def severity_level(severity: int) -> int:
    """The ``logging`` level of a TensorRT severity."""
    return _LEVELS.get(severity, logging.DEBUG)


def wanted(severity: int) -> bool:
    """Whether a message of this severity goes anywhere: errors always (a capture may want them),
    the rest only when the logger would emit their level. TensorRT hands a Python logger every
    message, VERBOSE included, each with the GIL taken; answering "no" first keeps that cost to
    the call itself during a build (a Python ``ILogger`` cannot filter inside TensorRT)."""
    return severity <= _ERROR_SEVERITY or log.isEnabledFor(severity_level(severity))


def record(severity: int, msg: str) -> None:
    """Log one TensorRT message and remember it if it is an error and a capture is open."""
    if not wanted(severity):
        return
    level = severity_level(severity)
    if log.isEnabledFor(level):
        log.log(level, "%s", msg)
    if severity <= _ERROR_SEVERITY:
        for sink in getattr(_local, "sinks", ()):
            sink.append(msg)


@contextlib.contextmanager
def capture_errors() -> Iterator[list[str]]:
    """Collect the errors TensorRT logs on this thread inside the block."""
    sinks: list[list[str]] = getattr(_local, "sinks", [])
    _local.sinks = sinks
    errors: list[str] = []
    sinks.append(errors)
    try:
        yield errors
    finally:
        sinks.remove(errors)


def _make_logger() -> trt.ILogger:
    import tensorrt as trt

    # Without the stubs on mypy's path (the project's plain run) tensorrt is Any; with them
    # (tests/unit/test_tensorrt_backend.py) it is typed: the ignore serves the first case only.
    class _Bridge(trt.ILogger):  # type: ignore[misc, unused-ignore]
        def __init__(self) -> None:
            trt.ILogger.__init__(self)

        def log(self, severity: trt.ILogger.Severity, msg: str) -> None:
            record(int(severity), msg)

    return _Bridge()


def get_logger() -> trt.ILogger:
    """The process's TensorRT logger (created on first use, kept for the process's life)."""
    global _logger
    with _lock:
        if _logger is None:
            _logger = _make_logger()
        return _logger
