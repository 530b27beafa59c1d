"""A queued request (``Work``) and what a model's worker thread does with a batch of them: copy
a request's inputs in from shared memory, run the instance (one request, or several joined along
the batch axis and split again), and hand each request's outputs to its sink.

Everything here runs on a worker thread and touches no event-loop state: the queue
(edged/serving/scheduler.py) hands the results back to the loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from time import perf_counter_ns
from typing import TYPE_CHECKING

import numpy as np

from edged.backends.base import Instance
from edged.errors import EdgedError
from edged.serving.sinks import InputSource, OutputShapes, OutputSink, run_into, signature

if TYPE_CHECKING:
    from edged.serving.stats import ModelStatistics

log = logging.getLogger("edged.serving.scheduler")

Tensors = Mapping[str, np.ndarray]


@dataclass(eq=False)
class Work:
    inputs: Tensors
    deadline: float  # time.monotonic()
    future: asyncio.Future[dict[str, np.ndarray]]
    request_id: str
    rows: int = 1
    signature: tuple[tuple[str, tuple[int, ...], str], ...] = field(default=())
    released: bool = False  # its slot of queue_depth was given back (only touched on the loop)
    expired: bool = False  # its deadline timer cancelled its future (only touched on the loop)
    # Statistics (edged/serving/stats.py): the record to add to (None: not counted), when it was queued,
    # how long it waited and how long its run took (set by the worker, read on the loop).
    stats: ModelStatistics | None = None
    enqueued_ns: int = 0
    queue_ns: int = 0
    infer_ns: int = 0
    sink: OutputSink | None = None
    source: InputSource | None = None


# A finished request: its work item, and its result or its error.
Done = tuple[Work, "dict[str, np.ndarray] | None", "BaseException | None"]
# A successful run: rows, and nanoseconds joining the inputs, running, splitting the outputs.
Timing = tuple[int, int, int, int]


@dataclass
class WorkerState:
    """What the watchdog reads: a worker stuck on one batch for too long is unhealthy."""

    name: str
    busy_since: float | None = None
    batches: int = 0
    rows: int = 0
    waits: int = 0  # batches that waited for company (preferred sizes under load only)


def rows_of(inputs: Tensors) -> int:
    """The rows of a request whose first axis is a batch."""
    return next(iter(inputs.values())).shape[0] if inputs else 1


def fill(model: str, w: Work) -> BaseException | None:
    """The request's inputs copied in by this worker (``Work.source``): None, or the copy's
    error, which answers the request."""
    assert w.source is not None
    try:
        w.source.fill()
    except EdgedError as e:
        return e
    except Exception as e:  # never let one request kill a worker
        log.exception("copying a request's inputs failed", extra={"model": model})
        return e
    finally:
        w.source = None  # nothing of the client's regions kept by the work item
    return None


def run_batch(model: str, inst: Instance, batch: list[Work], shapes: OutputShapes) -> tuple[list[Done], Timing | None]:
    """The batch's results, and the time spent joining its inputs, running the backend and
    splitting its outputs (None when it failed). ``shapes``: the model's output shapes learnt
    from runs with an OutputSink, for its ``bind``."""
    try:
        if len(batch) == 1:
            return _run_one(model, inst, batch[0], shapes)
        t0 = perf_counter_ns()
        names = list(batch[0].inputs)
        joined = {n: np.concatenate([w.inputs[n] for w in batch]) for n in names}
        t1 = perf_counter_ns()
        out = inst.infer(joined, checked=True)
        t2 = perf_counter_ns()
        results: list[Done] = []
        start = 0
        for w in batch:
            end = start + w.rows
            w.infer_ns = t2 - t1
            mine = {k: v[start:end] for k, v in out.items()}
            if w.sink is not None:
                w.sink.run(mine)
            results.append((w, mine, None))
            start = end
        return results, (start, t1 - t0, t2 - t1, perf_counter_ns() - t2)
    except EdgedError as e:
        return [(w, None, e) for w in batch], None
    except Exception as e:  # never let one request kill a worker
        log.exception("worker failed", extra={"model": model})
        return [(w, None, e) for w in batch], None


def _run_one(model: str, inst: Instance, w: Work, shapes: OutputShapes) -> tuple[list[Done], Timing | None]:
    sink = w.sink
    into: dict[str, np.ndarray] = {}
    t0 = perf_counter_ns()
    try:
        if sink is not None:
            key = signature(w.inputs)  # once: the guess before the run, the lesson after it
            if inst.runs_into:
                into = sink.bind(shapes.guess(key), w.inputs)
        out = run_into(inst, w.inputs, into, model) if into else inst.infer(w.inputs, checked=True)
        if sink is not None:
            shapes.learn(key, out)
    except BaseException:
        into.clear()  # no array over a client's mapping kept by the error's frames
        if sink is not None:
            sink.run({})  # the regions it held for the run are let go
        raise
    w.infer_ns = ran = perf_counter_ns() - t0
    if sink is not None:
        sink.run(out)
    return [(w, out, None)], (w.rows, 0, ran, 0)
