"""Signals from the first instruction of ``edged serve``.

Python's default actions would kill a daemon that gets SIGHUP (exit 129) or SIGTERM while it
imports and reads its config, before its event loop exists: a stale socket, an orphaned build
child. These handlers only remember the signals; the daemon handles them once its loop runs (a
stop stops the start-up, a reload runs after READY=1). Standard library only: it is the first
thing ``serve`` imports.
"""

from __future__ import annotations

import signal
from types import FrameType

HELD = (signal.SIGHUP, signal.SIGTERM, signal.SIGINT)
_pending: list[int] = []


def _remember(signum: int, frame: FrameType | None) -> None:
    _pending.append(signum)


def hold() -> None:
    for sig in HELD:
        signal.signal(sig, _remember)


def take() -> list[int]:
    """The signals that arrived before the loop took over, oldest first."""
    taken = list(_pending)
    _pending.clear()
    return taken
