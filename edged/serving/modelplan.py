"""A model's request plan: what every request to it is checked against, built once per load and
config, and the decoding that uses it (``decode_now``, for a body decoded on the caller's thread)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from edged.backends.base import Backend
from edged.config import Config, ModelConfig, parse_size
from edged.errors import BadRequestError
from edged.serving.registry import ModelRuntime
from edged.serving.reshape import Reshaper, reshaper
from edged.serving.scheduler import elements_of
from edged.wire.decode import MAX_TENSORS, InferRequest, Limits, ShmResolver, decode_infer
from edged.wire.tensors import is_bytes
from edged.wire.validate import InputRules

# Decoder plans remembered as checked, per model plan (then forgotten all at once).
_PASSED = 256


@dataclass(frozen=True)
class ModelPlan:
    """What every request to one model is checked against, built once per load and config (a
    reload, a swap or a lazy model's load changes one of the three it was built from)."""

    cfg: Config
    model_cfg: ModelConfig
    backend: Backend | None
    limits: Limits  # what a request may name, before its tensors are decoded
    outputs: frozenset[str]  # the model's output names (empty: not loaded)
    rules: InputRules | None  # its inputs' names, datatypes and shapes (None: not loaded)
    timeout_s: float
    # A repository model whose clients see other shapes than the model has (its reshapes).
    reshape: Reshaper | None = None
    # The decoder's plans (InferRequest.shapes, hashed by identity) whose inputs passed
    # ``rules``, with their element count: a stream of requests with one header is checked once.
    passed: dict[object, int] = field(default_factory=dict, compare=False)

    def checked(self, inputs: Mapping[str, np.ndarray], shapes: object) -> int:
        """``rules.check(inputs)``, remembered by ``shapes`` (see above); the inputs' elements.
        ``inputs``: as the model takes them (``to_model``)."""
        elements = self.passed.get(shapes)  # never stored under None
        if elements is not None:
            return elements
        assert self.rules is not None  # READY with a queue: loaded
        self.rules.check(inputs)
        elements = elements_of(inputs)
        if shapes is not None:
            if len(self.passed) >= _PASSED:
                self.passed.clear()
            self.passed[shapes] = elements
        return elements

    def current(self, cfg: Config, rt: ModelRuntime) -> bool:
        return self.cfg is cfg and self.model_cfg is rt.cfg and self.backend is rt.backend

    def to_model(self, inputs: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        return inputs if self.reshape is None else self.reshape.to_model(inputs)

    def to_api(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return outputs if self.reshape is None else self.reshape.to_api(outputs)


def make_plan(cfg: Config, rt: ModelRuntime) -> ModelPlan:
    max_json = parse_size(cfg.server.max_json)
    inputs, outputs = rt.inputs, rt.outputs
    if inputs and outputs:
        strings = frozenset(s.name for s in inputs if is_bytes(s.np_dtype))
        limits = Limits(len(inputs), len(outputs), rt.name, max_json, strings)
    else:  # not loaded yet: its counts are unknown
        limits = Limits(MAX_TENSORS, MAX_TENSORS, rt.name, max_json)
    rules = None
    if rt.backend is not None:
        # The backend's input rules narrowed by the model's config (edged/wire/validate.py owns them).
        bounds = {n: (tuple(p.min), tuple(p.max)) for n, p in rt.cfg.profiles.items()}
        rules = rt.backend.input_rules.narrowed(rt.name, bounds, rt.cfg.max_batch)
    timeout_s = (rt.cfg.timeout_ms or cfg.server.request_timeout_ms) / 1000
    shapes = reshaper(cfg.repository.get(rt.name))
    return ModelPlan(cfg, rt.cfg, rt.backend, limits, frozenset(s.name for s in outputs), rules, timeout_s, shapes)


def shown(reshape: Reshaper | None, name: str, shape: tuple[int, ...], output: bool) -> tuple[int, ...]:
    return shape if reshape is None else reshape.shown(name, shape, output)


def decode_now(
    plan: ModelPlan, body: bytes | memoryview, header_length: int | None, shm: ShmResolver | None
) -> InferRequest:
    """``Service.decode_infer`` on the caller's thread, for a body of at most OFFLOAD_BYTES."""
    return outputs_checked(plan, decode_infer(body, header_length, shm, plan.limits))


def outputs_checked(plan: ModelPlan, req: InferRequest) -> InferRequest:
    """``req``, once every output it asks for is one of the model's."""
    if req.outputs is not None and plan.outputs:
        for out in req.outputs:
            if out.name not in plan.outputs:
                raise BadRequestError(f"requested output '{out.name}' is not an output of '{plan.limits.model}'")
    return req
