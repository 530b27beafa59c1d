"""Plain JSON requests with their values inline are planned once per form (the document without
its values and its id: edged/wire/decode.py's ``_form``): every request read through a
remembered form must decode as a fresh cache decodes the same bytes, values, ids and errors alike."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import orjson
import pytest

from edged.errors import EdgedError
from edged.wire import decode
from edged.wire.decode import decode_infer
from edged.wire.plans import PLANS
from edged.wire.validate import Limits

pytestmark = pytest.mark.usefixtures("empty_plans")


@pytest.fixture
def planned(calls_of: Any) -> list[tuple[Any, ...]]:
    """The documents the planner saw (decode.plan_document, the real one)."""
    return calls_of(decode, "plan_document")  # type: ignore[no-any-return]


def _outcome(body: bytes, limits: Limits = decode.DEFAULT_LIMITS) -> Any:
    try:
        req = decode_infer(body, None, limits=limits)
    except EdgedError as e:
        return type(e).__name__, str(e)
    inputs = {k: (v.dtype.str, v.shape, v.tolist()) for k, v in req.inputs.items()}
    outputs = None if req.outputs is None else [(o.name, o.binary) for o in req.outputs]
    return req.id, inputs, outputs, req.binary_all, req.parameters


def _fresh(body: bytes, limits: Limits = decode.DEFAULT_LIMITS) -> Any:
    kept = list(PLANS._plans.items())
    PLANS.clear()
    try:
        return _outcome(body, limits)
    finally:
        PLANS.clear()
        for key, plan in kept:
            PLANS.put(key, plan)


def test_a_clients_json_requests_are_planned_once_with_their_own_values(planned: list[tuple[Any, ...]]) -> None:
    for i in range(5):
        doc = {
            "id": f"frame-{i}",
            "inputs": [
                {"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [i, i + 0.5, -i]},
                {"name": "n", "shape": [2], "datatype": "INT64", "data": [i, 2 * i]},
            ],
            "outputs": [{"name": "y"}],
        }
        req = decode_infer(orjson.dumps(doc))
        assert req.id == f"frame-{i}"
        assert req.inputs["x"].tolist() == [[i, i + 0.5, -i]] and req.inputs["n"].tolist() == [i, 2 * i]
    assert len(planned) == 1 and len(PLANS) == 1


def test_json_requests_read_through_forms_match_the_planned_path() -> None:
    """Seeded: requests of a few forms with random values, ids and faults, each decoded as a fresh
    cache decodes it."""
    rng = random.Random(20261207)
    forms: list[dict[str, Any]] = [
        {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32"}]},
        {"inputs": [{"name": "x", "shape": [2], "datatype": "INT32"}], "outputs": [{"name": "y"}]},
        {"inputs": [{"name": "s", "shape": [2], "datatype": "BYTES"}], "parameters": {"binary_data_output": True}},
        {"inputs": [{"name": "b", "shape": [3], "datatype": "BOOL"}, {"name": "x", "shape": [1], "datatype": "FP64"}]},
    ]
    values: dict[str, Any] = {
        "FP32": lambda n: [rng.uniform(-5, 5) for _ in range(n)],
        "INT32": lambda n: [rng.randrange(-(2**31), 2**31) for _ in range(n)],
        "BYTES": lambda n: ["".join(rng.choice("ab é") for _ in range(rng.randrange(4))) for _ in range(n)],
        "BOOL": lambda n: [rng.random() < 0.5 for _ in range(n)],
        "FP64": lambda n: [rng.uniform(-1e300, 1e300) for _ in range(n)],
    }
    faults = [
        lambda inp: inp.update(data=inp["data"][:-1]),  # too few values
        lambda inp: inp.update(data=["x"] * len(inp["data"])),  # the wrong type
        lambda inp: inp.update(data=True),
        lambda inp: inp.pop("data"),
        lambda inp: inp.update(data=[inp["data"]]),  # nested one level more
    ]
    for _ in range(500):
        doc = orjson.loads(orjson.dumps(rng.choice(forms)))
        for inp in doc["inputs"]:
            inp["data"] = values[inp["datatype"]](int(np.prod(inp["shape"])))
        if rng.random() < 0.2:
            rng.choice(faults)(rng.choice(doc["inputs"]))
        if rng.random() < 0.6:
            doc["id"] = rng.choice([f"r{rng.randrange(99)}", rng.randrange(99), True, None, 1.5])
        body = orjson.dumps(doc)
        assert _outcome(body) == _fresh(body), body
    assert len(PLANS) <= len(forms)


def test_a_remembered_form_is_still_counted_against_each_models_limits() -> None:
    two = {"inputs": [{"name": n, "shape": [1], "datatype": "FP32", "data": [1.0]} for n in ("a", "b")]}
    body = orjson.dumps(two)
    assert _outcome(body)[0] == ""
    assert _outcome(body, Limits(1, 1, "m")) == _fresh(body, Limits(1, 1, "m"))
    assert _outcome(body, Limits(1, 1, "m"))[0] == "InvalidInputError"


def test_a_form_key_cannot_be_sent_as_a_request() -> None:
    body = orjson.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]})
    decode_infer(body)
    (key,) = PLANS._plans
    assert key.startswith(b"\x00")
    assert _outcome(key)[0] == "BadRequestError"
