"""Preferred batch sizes: which requests a batch runs with (Triton's dynamic batcher's rule).

With ``preferred_batch`` sizes, a worker that has gathered compatible requests (in arrival
order, at most ``max_batch`` rows) runs at once with the longest run of them, from the first,
whose rows are a preferred size; and when the next request would take the batch past the
largest preferred size, it runs with those before it. Otherwise it waits for company up to
``max_queue_delay_us``, then runs with all it has. Triton's ``GetDynamicBatch`` decides the same
way (triton-inference-server/core, ``src/dynamic_batch_scheduler.cc``).
"""

from __future__ import annotations

from collections.abc import Sequence


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
