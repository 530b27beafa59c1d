"""Deadline waits for the system tests: poll a condition until it holds or a deadline passes, and
open a FIFO's write end once a reader has it. Nothing in the harness sleeps to synchronise.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def wait_until(check: Callable[[], T | None], timeout: float, what: str, poll: float = 0.02) -> T:
    """Poll ``check`` until it returns something other than None/False, or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result is not None and result is not False:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(poll)  # the poll interval of a deadline loop, not a synchronisation


def open_fifo_writer(path: Path, timeout: float = 20) -> int:
    """Open a FIFO for writing once a reader has it open; never blocks past the deadline."""

    def opened() -> int | None:
        try:
            return os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno == errno.ENXIO:  # no reader yet
                return None
            raise

    return wait_until(opened, timeout, f"a reader on {path}")
