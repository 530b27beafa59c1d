"""Which queued requests a batch runs with: those of the first's shapes, and with preferred
sizes, Triton's dynamic batcher's rule.

With ``preferred_batch`` sizes, a worker that has gathered compatible requests (in arrival
order, at most its batch limit in rows) runs at once with the longest run of them, from the
first, whose rows are a preferred size; and when the next request would take the batch past the
largest preferred size, it runs with those before it. Triton's ``GetDynamicBatch`` cuts the same
way (triton-inference-server/core, ``src/dynamic_batch_scheduler.cc``). Otherwise the scheduler
lets a batch of several requests wait for company up to ``max_queue_delay_us`` from its oldest
request's arrival, then run with all it has; a batch of one never waits (scheduler.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Protocol, TypeVar


class Queued(Protocol):
    """A queued request as the batch sees it: its rows and its inputs' shapes and dtypes."""

    @property
    def rows(self) -> int: ...

    @property
    def signature(self) -> object: ...


Q = TypeVar("Q", bound=Queued)


def add_compatible(queue: deque[Q], batch: list[Q], rows: int, limit: int) -> tuple[int, bool]:
    """Move the queued requests of the batch's shapes (``batch[0]``'s) into it, in arrival
    order, while its ``rows`` stay within ``limit``; returns its rows and whether a compatible
    request was left out because it did not fit (then the batch runs with what it has)."""
    first, blocked = batch[0], False
    for w in list(queue) if rows < limit else ():  # at most queue_depth items: bounded
        if w.signature != first.signature:
            continue
        if rows + w.rows > limit:
            blocked = True
            continue
        queue.remove(w)
        batch.append(w)
        rows += w.rows
        if rows >= limit:
            break
    return rows, blocked


def preferred_cut(rows: Sequence[int], preferred: Sequence[int], largest: int) -> int:
    """How many of the gathered requests (their ``rows``, in order) to run now; 0 when none
    makes a batch of a preferred size yet (then the batch waits, or runs whole once it is late)."""
    best, total = 0, 0
    for i, n in enumerate(rows):
        if i and not best and total + n > largest:
            best = i  # the batch cannot reach a preferred size without passing the largest
        total += n
        if total in preferred:
            best = i + 1
    return best
