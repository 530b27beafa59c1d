"""Replacing the runtime that serves a model by another one: a reload's new version, or the
engine a background build finished in place of its stand-in.

When both fit in memory the new one is loaded and warmed beside the old, swapped in with one dict
assignment and the old one retired (the callers do that, it needs nothing from here but
``retire``). When they do not fit together, ``swap_held`` holds the model's requests (they wait on
the registry's ``holds``, they do not fail), retires the old one, loads the new one and releases
the hold; what happens when the new one does not load is the caller's policy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from edged.serving.registry import ModelRuntime, Registry
from edged.serving.states import ModelState

log = logging.getLogger(__name__)

# Called as on_failure(old, new) when the new runtime does not load, still under the hold and with
# the old runtime registered again; the error propagates after it.
OnFailure = Callable[[ModelRuntime, ModelRuntime], Awaitable[None]]


def hold(reg: Registry, name: str) -> asyncio.Event:
    """Hold ``name``'s requests (a swap that cannot keep both versions loaded): they wait on
    the returned event until ``release``."""
    held = reg.holds[name] = asyncio.Event()
    return held


def release(reg: Registry, name: str, held: asyncio.Event) -> None:
    if reg.holds.get(name) is held:
        del reg.holds[name]
    held.set()


async def retire(reg: Registry, old: ModelRuntime, why: str) -> None:
    """Let the requests already queued for a replaced model finish, then unload it."""
    queue = old.queue
    deadline = time.monotonic() + reg.cfg.lifecycle.drain_timeout_s
    while queue is not None and queue.backlog and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    if old.backend is not None:
        await reg.unload(old, ModelState.UNLOADED, why, notify=reg.models.get(old.name) is old)


async def swap_held(
    reg: Registry,
    old: ModelRuntime,
    new: ModelRuntime,
    loop: asyncio.AbstractEventLoop,
    why: str,
    on_failure: OnFailure,
) -> None:
    """Replace the registered ``old`` by ``new`` when the two do not fit in memory together:
    hold, retire ``old`` (``why`` is its reason), register and load ``new``, release. When ``new``
    does not load, ``old`` is registered again and ``on_failure(old, new)`` decides the rest (load
    it back at once, or leave that to a transaction's rollback) before the error propagates.
    The hold is released whatever happens."""
    log.warning(
        "%s: the serving runtime (%s) and its replacement (%s) do not fit together; requests wait during the swap",
        new.name,
        old.serving_on,
        new.serving_on,
        extra={"model": new.name},
    )
    held = hold(reg, new.name)
    try:
        await retire(reg, old, why)
        reg.models[new.name] = new
        try:
            await reg.load(new, loop)
        except BaseException:
            reg.models[new.name] = old
            await on_failure(old, new)
            raise
    finally:
        release(reg, new.name, held)
