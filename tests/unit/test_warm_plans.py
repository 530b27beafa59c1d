"""The warm-up plans the headers edged's own client sends, so that its first request finds them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from edged.client import encode_request
from edged.lifecycle.path_warmup import _bodies, _warm_planning
from edged.wire.decode import InferRequest, decode_infer
from edged.wire.plans import PLANS

INPUTS: dict[str, np.ndarray] = {"x": np.zeros((1, 16), np.float32), "mask": np.ones((1, 4), np.int64)}
OUTPUTS = ["probs", "logits"]


class FakeService:
    """Pure-logic stand-in for edged.serving.service.Service: decodes as its decode_infer does, without
    a model behind it (the limits are the defaults)."""

    def __init__(self) -> None:
        self.decoded = 0

    async def decode_infer(self, model: str, body: bytes, header_length: int | None) -> InferRequest:
        self.decoded += 1
        return decode_infer(body, header_length)


@pytest.fixture
def warm_plans() -> Iterator[FakeService]:
    """The plan cache as the warm-up leaves it: its requests (they carry an id), then its planning."""
    PLANS.clear()
    for body, length in _bodies(INPUTS, OUTPUTS)[:2]:
        decode_infer(body, length)
    service = FakeService()
    app: Any = SimpleNamespace(service=service)
    asyncio.run(_warm_planning(app, "m", INPUTS, OUTPUTS))
    yield service
    PLANS.clear()


@pytest.mark.parametrize("outputs", [None, OUTPUTS])
@pytest.mark.parametrize("request_id", ["", "frame-7"])
def test_the_clients_first_request_finds_its_plan(
    warm_plans: FakeService, outputs: list[str] | None, request_id: str
) -> None:
    assert warm_plans.decoded > 2
    planned = len(PLANS)
    body, headers = encode_request(INPUTS, outputs, request_id)
    req = decode_infer(body, int(headers["Inference-Header-Content-Length"]))
    assert req.id == request_id and set(req.inputs) == set(INPUTS)
    assert len(PLANS) == planned, "the client's header was planned anew: the warm-up did not plan its form"
