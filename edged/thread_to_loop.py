"""Handing work from another thread to the event loop.

A worker thread, a copier or closer thread, a language model's slot or paho's connect thread may
finish after the loop has closed (the daemon exiting): ``call_soon_threadsafe`` then raises
RuntimeError, which would end that thread with a traceback. There is nobody left to tell, so the
call is dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


def to_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> bool:
    """``fn(*args)`` on ``loop``, from any thread; False when the loop has closed."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        return False
    return True
