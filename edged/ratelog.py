"""Log lines a client can cause, at most one per kind every few seconds (with the count of those
left out), so that a flood of bad connections or messages cannot fill the journal."""

from __future__ import annotations

import logging
import time
from typing import Any

EVERY_S = 10.0


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, every_s: float = EVERY_S) -> None:
        self._log = logger
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def note(self, level: int, kind: str, message: str, *args: Any, **kwargs: Any) -> None:
        """Log ``message % args`` unless a line of this ``kind`` was logged within ``every_s``.
        ``kind`` is chosen by the caller from a fixed set, so the two dicts stay small."""
        now = time.monotonic()
        if now - self._last.get(kind, -self.every_s) < self.every_s:
            self._quiet[kind] = self._quiet.get(kind, 0) + 1
            return
        more = self._quiet.pop(kind, 0)
        self._last[kind] = now
        suffix = f" (and {more} more like it)" if more else ""
        self._log.log(level, message + "%s", *args, suffix, **kwargs)
