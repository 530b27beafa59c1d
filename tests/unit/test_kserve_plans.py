"""gRPC requests planned once: a ModelInferRequest of raw contents with no parameters is
decoded by the plan remembered for its names, datatypes, shapes and outputs, whatever its id and
bytes, and any other request is planned whole (and its faults named as before)."""

from __future__ import annotations

import numpy as np
import pytest

from edged.errors import BadRequestError
from edged.wire.decode import DEFAULT_LIMITS, Limits
from edged.wire.kserve import PLANS, plan_key, planned_request
from edged.wire.proto import grpc_service_pb2 as pb


def _request(rid: str = "", rows: int = 1, raw: bytes | None = None, name: str = "x") -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name="tiny", id=rid)
    msg.inputs.add(name=name, datatype="FP32", shape=[rows, 16])
    msg.raw_input_contents.append(raw if raw is not None else np.arange(rows * 16, dtype=np.float32).tobytes())
    msg.outputs.add(name="probs")
    return msg


def test_requests_of_one_client_share_one_plan_and_keep_their_ids() -> None:
    PLANS.clear()
    first = planned_request(_request("a"), None, DEFAULT_LIMITS)
    second = planned_request(_request("b", raw=np.ones(16, np.float32).tobytes()), None, DEFAULT_LIMITS)
    assert first is not None and second is not None
    assert first.shapes is second.shapes is not None  # one plan: the model's check is remembered by it
    assert len(PLANS) == 1
    assert (first.id, second.id) == ("a", "b")
    np.testing.assert_array_equal(second.inputs["x"], np.ones((1, 16), np.float32))
    assert [o.name for o in second.outputs or ()] == ["probs"]


def test_other_shapes_and_names_are_other_plans() -> None:
    PLANS.clear()
    keys = {plan_key(_request(rows=1)), plan_key(_request(rows=2)), plan_key(_request(name="y"))}
    assert None not in keys and len(keys) == 3
    # Length-prefixed names: a name that spells another request's fields is not that request.
    assert plan_key(_request(name="x4:FP32[1, 16]1:x")) != plan_key(_request())


def test_requests_not_of_that_kind_are_planned_whole() -> None:
    PLANS.clear()
    wrong_size = _request(raw=b"\0" * 60)
    assert planned_request(wrong_size, None, DEFAULT_LIMITS) is None  # the full decoder says why
    planned_request(_request(), None, DEFAULT_LIMITS)
    assert planned_request(wrong_size, None, DEFAULT_LIMITS) is None  # also once the plan is known
    typed = pb.ModelInferRequest(model_name="tiny")
    typed.inputs.add(name="x", datatype="FP32", shape=[1, 1]).contents.fp32_contents.append(1.0)
    with_params = _request()
    with_params.parameters["priority"].int64_param = 1
    assert plan_key(typed) is None and plan_key(with_params) is None


def test_a_remembered_plan_is_held_to_each_models_limits() -> None:
    PLANS.clear()
    assert planned_request(_request(), None, DEFAULT_LIMITS) is not None
    with pytest.raises(BadRequestError):
        planned_request(_request(), None, Limits(inputs=1, outputs=0, model="none"))
