"""Tensors that clients see in another shape than the model has (a repository's ``reshape``),
or in narrower dims than the model's that no profile can state (``dims: [4, -1]`` of a model
that takes any size in both).

A request's input arrives in the shape config.pbtxt's ``dims`` give; it is checked against
them and reshaped (a view: the same elements, row-major) to the model's own before the input
rules see it, and an output goes back the other way before it is encoded. The first dimension
of a batched model is the batch on both sides.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from edged.config import RepositoryModel
from edged.errors import InvalidInputError

Tensors = Mapping[str, np.ndarray]


class Reshaper:
    def __init__(self, origin: RepositoryModel) -> None:
        self.batched = origin.batched
        self.inputs = dict(origin.input_reshape)
        self.outputs = dict(origin.output_reshape)

    def _lead(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape[:1] if self.batched else ()

    def to_model(self, inputs: Tensors) -> Tensors:
        """``inputs`` as the model takes them; a shape that is not config.pbtxt's is invalid_input."""
        out = dict(inputs)
        for name, r in self.inputs.items():
            arr = inputs.get(name)
            if arr is None:
                continue  # the input rules name what is missing
            lead = self._lead(arr.shape)
            if (self.batched and not arr.shape) or not _fits(arr.shape[len(lead) :], r.api):
                want = ([-1] if self.batched else []) + r.api
                raise InvalidInputError(f"input '{name}': shape {list(arr.shape)} does not match {_fmt(want)}")
            out[name] = arr.reshape(lead + tuple(r.model))
        return out

    def as_sent(self, inputs: Tensors) -> dict[str, np.ndarray]:
        """Inputs the model takes, in the shapes a client sends them (the daemon's own warm-up
        requests are made from the model's shapes)."""
        out = dict(inputs)
        for name, r in self.inputs.items():
            arr = inputs.get(name)
            if arr is not None:
                out[name] = arr.reshape(self._lead(arr.shape) + tuple(r.api))
        return out

    def to_api(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``outputs`` in the shapes config.pbtxt gives clients."""
        for name, r in self.outputs.items():
            arr = outputs.get(name)
            if arr is not None:
                outputs[name] = arr.reshape(self._lead(arr.shape) + tuple(r.api))
        return outputs

    def shown(self, name: str, shape: tuple[int, ...], output: bool) -> tuple[int, ...]:
        """A tensor's shape as model metadata gives it to clients."""
        r = (self.outputs if output else self.inputs).get(name)
        return shape if r is None else self._lead(shape) + tuple(r.api)


def _fits(shape: tuple[int, ...], dims: list[int]) -> bool:
    return len(shape) == len(dims) and all(d in (-1, s) for s, d in zip(shape, dims))


def _fmt(shape: list[int]) -> str:
    return "[" + ", ".join("?" if d < 0 else str(d) for d in shape) + "]"


def reshaper(origin: Any) -> Reshaper | None:
    """The reshaper of a repository model that has reshapes; None for any other model."""
    if isinstance(origin, RepositoryModel) and (origin.input_reshape or origin.output_reshape):
        return Reshaper(origin)
    return None
