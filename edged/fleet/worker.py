"""The agent's one worker: which model to bring to its desired version next, one at a time
(builds run one at a time anyway, and one download at a time bounds the disk and the link), and
when to try a broken-off download again (``retry_s``, doubling, at most 16 times as long)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from edged.fleet.attempt import Attempt
from edged.fleet.desired import Target

if TYPE_CHECKING:
    from edged.fleet.context import Agent

log = logging.getLogger(__name__)


def needs_work(agent: Agent, name: str, t: Target) -> bool:
    rec = agent.book.models.get(name)
    if rec is None:
        return True
    if rec.current is not None and rec.current.sha256 == t.sha256:
        return False  # serving (or watching) it
    return t.key not in rec.blocked


async def work(agent: Agent) -> None:
    retry: dict[str, tuple[str, float, float]] = {}  # model -> (desired key, when, delay)
    while True:
        agent.changed.clear()
        now = time.monotonic()
        todo = [
            (name, t)
            for name, t in sorted(agent.wanted.items())
            if needs_work(agent, name, t) and not (name in retry and retry[name][0] == t.key and retry[name][1] > now)
        ]
        if not todo:
            waits = [when - now for key, when, _ in retry.values()]
            try:
                await asyncio.wait_for(agent.changed.wait(), min(waits) if waits else None)
            except asyncio.TimeoutError:
                pass
            continue
        name, t = todo[0]
        attempt = Attempt(agent, name, t)
        agent.current = attempt
        try:
            outcome = await attempt.run()
        except asyncio.CancelledError:
            attempt.cancel.set()  # the download thread stops at its next chunk
            raise
        except Exception as e:  # caught at the task's boundary: logged once, reported, never fatal
            log.exception("fleet: %s: the update failed", name, extra={"model": name})
            outcome = "retry"
            agent.set_phase(name, "downloading", f"{e.__class__.__name__}: {e}; trying again")
        finally:
            agent.current = None
        if outcome == "retry":
            _, _, delay = retry.get(name, ("", 0.0, agent.fleet.retry_s / 2))
            delay = min(delay * 2, agent.fleet.retry_s * 16)
            retry[name] = (t.key, time.monotonic() + delay, delay)
        else:
            retry.pop(name, None)
