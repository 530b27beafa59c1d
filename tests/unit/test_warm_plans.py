"""The warm-up plans the headers edged's own client sends, so that its first request finds them."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from edged.client import encode_request
from edged.protocol import PLANS, decode_infer
from edged.warmpath import _bodies

INPUTS: dict[str, np.ndarray] = {"x": np.zeros((1, 16), np.float32), "mask": np.ones((1, 4), np.int64)}
OUTPUTS = ["probs", "logits"]


@pytest.fixture
def warm_plans() -> Iterator[None]:
    """The plan cache as the warm-up leaves it: its requests (with an id) and the headers
    _warm_planning decodes without one."""
    PLANS.clear()
    for body, length in _bodies(INPUTS, OUTPUTS)[:2] + _bodies(INPUTS, OUTPUTS, ident=False)[:2]:
        decode_infer(body, length)
    yield
    PLANS.clear()


@pytest.mark.parametrize("outputs", [None, OUTPUTS])
@pytest.mark.parametrize("request_id", ["", "frame-7"])
def test_the_clients_first_request_finds_its_plan(warm_plans: None, outputs: list[str] | None, request_id: str) -> None:
    planned = len(PLANS)
    body, headers = encode_request(INPUTS, outputs, request_id)
    req = decode_infer(body, int(headers["Inference-Header-Content-Length"]))
    assert req.id == request_id and set(req.inputs) == set(INPUTS)
    assert len(PLANS) == planned, "the client's header was planned anew: the warm-up did not plan its form"
