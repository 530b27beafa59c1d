"""Where a request's inputs come from and its outputs go on the model's worker thread, and the
runs that put them there.

A request may come with an ``InputSource`` (its inputs' bytes, copied by the worker right before
the run) and an ``OutputSink`` (transports/shm/worker_writes.py: outputs bound for shared
memory). Before the run the worker asks it for arrays to run outputs straight into, in the shapes
the last run of the same input shapes gave (``OutputShapes``); after the run it hands it the
results. ``run_into`` makes such a run, and gives the guess up for good when the model's output
shapes turn out to depend on more than its input shapes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from edged.backends.base import Instance
from edged.wire.tensors import is_bytes

log = logging.getLogger(__name__)

Tensors = Mapping[str, np.ndarray]
# Expected outputs of a run: name -> (shape, type), as the last run of the same input shapes gave.
Shapes = Mapping[str, tuple[tuple[int, ...], "np.dtype[Any]"]]
Signature = tuple[tuple[str, tuple[int, ...], str], ...]

# Input signatures whose output shapes a model's queue remembers; past this, all are forgotten.
SHAPES_KEPT = 64


class OutputSink(Protocol):
    """Neither method raises."""

    def bind(self, shapes: Shapes, inputs: Tensors) -> dict[str, np.ndarray]:
        """Before the run: arrays to run outputs straight into (Instance.infer_into)."""
        ...

    def run(self, results: Mapping[str, np.ndarray]) -> None:
        """After the run, on the worker, whenever ``bind`` was called (results empty if it failed)."""
        ...


class InputSource(Protocol):
    """Where a request's input bytes come from, copied by the model's worker right before its
    run (transports/shm/worker_reads.py: inputs in POSIX shared memory)."""

    def fill(self) -> None:
        """On the worker: the inputs' bytes into the arrays the request holds. Raises the error
        the request fails with (an EdgedError for the client's fault)."""
        ...


class OutputShapes:
    """Per input signature, the output shapes and types of its last run (worker threads share it:
    single dict operations)."""

    def __init__(self) -> None:
        self._known: dict[Signature, Shapes] = {}

    def guess(self, key: Signature) -> Shapes:
        return self._known.get(key, {})

    def learn(self, key: Signature, out: Mapping[str, np.ndarray]) -> None:
        if key in self._known:
            return
        if len(self._known) >= SHAPES_KEPT:
            self._known.clear()
        self._known[key] = {n: (a.shape, a.dtype) for n, a in out.items() if not is_bytes(a.dtype)}


def run_into(inst: Instance, inputs: Tensors, into: Mapping[str, np.ndarray], model: str) -> dict[str, np.ndarray]:
    """``inst.infer_into``; a run that fails so is made again as a plain run, and when that one
    succeeds the instance runs plainly from then on."""
    try:
        return inst.infer_into(inputs, into)
    except Exception as e:
        failure = str(e)  # its text only: the error's frames hold the arrays over a client's mapping
    out = inst.infer(inputs, checked=True)  # raises again for a request the model cannot run
    # It runs, but not into arrays of the shapes the last run of these inputs gave: the model's
    # output shapes depend on more than its input shapes. No more guesses.
    log.warning("outputs are copied from now on: a run into them failed (%s)", failure, extra={"model": model})
    inst.runs_into = False
    return out


def signature(inputs: Tensors) -> Signature:
    """What ``OutputShapes`` knows a run by: its inputs' names, shapes and types."""
    return tuple((name, arr.shape, arr.dtype.str) for name, arr in inputs.items())
