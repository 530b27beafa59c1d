"""The decoder's plan cache (``PLANS`` of edged.wire.decode): which headers it remembers and
within what bounds, requests that differ only in their id sharing one plan while each keeps its
own id, plain JSON requests planned once per form, and a cached plan still held to each model's
limits."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import orjson
import pytest

from edged.errors import BadRequestError, InvalidInputError
from edged.wire.decode import PLANS, Limits, decode_infer


def _binary_header(inputs: list[dict[str, object]], **extra: object) -> bytes:
    return orjson.dumps({"inputs": inputs, **extra})


def test_plan_cache_keeps_only_successful_small_headers_and_is_bounded_by_bytes() -> None:
    PLANS.clear()
    inp: dict[str, object] = {"name": "x", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": 4}}
    good = _binary_header([inp])
    decode_infer(good + b"\0" * 4, len(good))
    assert len(PLANS) == 1
    # A header whose request fails (binary size mismatch) is not remembered...
    bad = _binary_header([inp], id="failing")
    with pytest.raises(BadRequestError):
        decode_infer(bad + b"\0" * 8, len(bad))
    assert len(PLANS) == 1
    # ...nor is a large header, even of a good request (255 x 4 MiB pinned 1.5 GB before).
    big = _binary_header([inp], id="x" * (64 * 1024))
    for _ in range(3):
        decode_infer(big + b"\0" * 4, len(big))
    assert len(PLANS) == 1
    # Many distinct small headers: the cache stays within its byte bound.
    for i in range(2000):
        h = _binary_header([inp], parameters={"tag": "y" * 900 + str(i)})
        decode_infer(h + b"\0" * 4, len(h))
    assert PLANS.bytes <= PLANS.max_bytes
    assert len(PLANS) < 2000
    PLANS.clear()


def test_requests_that_differ_only_in_their_id_share_one_plan_and_keep_their_own_id() -> None:
    PLANS.clear()
    inp: dict[str, object] = {"name": "x", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": 4}}
    seen = []
    # tritonclient writes the id first, edged.client last; a number is an id too.
    for rid in ("a", "b", 7, "c" * 100):
        for h in (_binary_header([inp], id=rid), orjson.dumps({"id": rid, "inputs": [inp]})):
            req = decode_infer(h + b"\0" * 4, len(h))
            seen.append(req.id)
            assert req.id == str(rid)
    # One plan, whatever the id and wherever it stands: under the header without its id, and
    # under each client's template (the id first, and last).
    assert PLANS.distinct() == 1 and len(PLANS) == 3
    # A request without an id, after them, is planned (and answered) without one.
    h = _binary_header([inp])
    assert decode_infer(h + b"\0" * 4, len(h)).id == ""
    assert len(seen) == 8
    PLANS.clear()


@pytest.mark.parametrize("rid", [True, None, [1], {"a": 1}, 1.5])
def test_a_bad_id_is_refused_even_when_the_rest_is_planned(rid: object) -> None:
    PLANS.clear()
    inp: dict[str, object] = {"name": "x", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": 4}}
    good = _binary_header([inp], id="ok")
    decode_infer(good + b"\0" * 4, len(good))
    bad = _binary_header([inp], id=rid)
    with pytest.raises(BadRequestError, match="'id' must be a string"):
        decode_infer(bad + b"\0" * 4, len(bad))
    PLANS.clear()


def test_numbered_requests_do_not_push_other_plans_out() -> None:
    """Keyed whole, 2,000 numbered requests of one client filled the cache and evicted the
    plan of another client's header."""
    PLANS.clear()
    inp: dict[str, object] = {"name": "x", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": 4}}
    other = _binary_header([dict(inp, name="y")])
    decode_infer(other + b"\0" * 4, len(other))
    for i in range(2000):
        h = _binary_header([inp], id="z" * 900 + str(i))
        assert decode_infer(h + b"\0" * 4, len(h)).id.endswith(str(i))
    assert PLANS.distinct() == 2 and len(PLANS) == 3  # the other's, and the numbered client's twice
    assert PLANS.get(other) is not None
    PLANS.clear()


def test_ids_that_only_look_like_the_member_take_the_normal_path() -> None:
    PLANS.clear()
    inp: dict[str, object] = {"name": "x", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": 4}}
    # "id" inside parameters only, and a header with NaN (read by the standard library).
    nested = _binary_header([inp], parameters={"id": "p"})
    assert decode_infer(nested + b"\0" * 4, len(nested)).id == ""
    with_nan = b'{"id": "n", "inputs": [' + orjson.dumps(inp) + b'], "parameters": {"t": NaN}}'
    req = decode_infer(with_nan + b"\0" * 4, len(with_nan))
    assert req.id == "n" and math.isnan(req.parameters["t"])
    PLANS.clear()


def test_a_header_nested_deeper_than_orjson_writes_still_decodes_with_its_id() -> None:
    """orjson reads 1024 levels and writes 254: the key without the id could not be written, and
    a TypeError escaped (a 500 and a traceback per request)."""
    PLANS.clear()
    inp: dict[str, object] = {"name": "x", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": 4}}
    deep = b"[" * 300 + b"]" * 300
    h = b'{"id":"r1","inputs":[' + orjson.dumps(inp) + b'],"parameters":{"p":' + deep + b"}}"
    assert decode_infer(h + b"\0" * 4, len(h)).id == "r1"
    PLANS.clear()


def test_the_plans_cached_without_their_id_cannot_be_reached_by_a_header() -> None:
    PLANS.clear()
    inp: dict[str, object] = {"name": "x", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": 4}}
    h = _binary_header([inp], id="secret-layout")
    decode_infer(h + b"\0" * 4, len(h))
    probe = b"\x00without id:" + _binary_header([inp])
    with pytest.raises(BadRequestError, match="malformed JSON"):
        decode_infer(probe + b"\0" * 4, len(probe))
    PLANS.clear()


def test_cached_plan_still_obeys_the_model_limits() -> None:
    PLANS.clear()
    a: dict[str, object] = {"name": "a", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": 4}}
    b = dict(a, name="b")
    h = _binary_header([a, b])
    decode_infer(h + b"\0" * 8, len(h))
    with pytest.raises(InvalidInputError, match="lists 2 inputs"):
        decode_infer(h + b"\0" * 8, len(h), limits=Limits(1, 1, "m"))
    PLANS.clear()


def test_a_plain_json_request_with_its_tensors_in_shared_memory_is_planned_once(calls_of: Any) -> None:
    import edged.wire.decode as protocol

    planned = calls_of(protocol, "plan_document")
    PLANS.clear()
    shm = {"shared_memory_region": "r", "shared_memory_byte_size": 4}
    inp = {"name": "x", "shape": [1], "datatype": "FP32", "parameters": shm}
    body = orjson.dumps({"inputs": [inp], "outputs": [{"name": "y", "parameters": shm}]})
    region = bytearray(np.float32(2.5).tobytes())
    for _ in range(3):  # Triton's clients send this form, the same bytes for every frame
        req = decode_infer(body, None, lambda n, o, s: memoryview(region)[o : o + s])
        assert req.inputs["x"][0] == 2.5
        assert req.outputs is not None and req.outputs[0].shm_region == "r"
    assert len(planned) == 1
    assert len(PLANS) == 1
    # With its values inline, a plain JSON request is planned once per form, its values (and
    # its id) read from each request.
    for i, value in enumerate((1.5, -3.0, 7.25)):
        doc = {"id": f"r{i}", "inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [value]}]}
        req = decode_infer(orjson.dumps(doc))
        assert req.inputs["x"][0] == value and req.id == f"r{i}"
    assert len(planned) == 2
    assert len(PLANS) == 2
    PLANS.clear()


def test_a_cached_header_is_still_counted_against_each_models_limits() -> None:
    """Whoever cached a header, a model with fewer inputs refuses one holding more JSON objects
    than its requests can (the count that bounds parsing is not skipped on a cache hit)."""
    PLANS.clear()
    shm = {"shared_memory_region": "r", "shared_memory_byte_size": 4}
    # 700 objects in 4-8 KiB: cacheable, and refused by a small model
    many: dict[str, object] = {f"k{i}": {} for i in range(700)}
    body = orjson.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "parameters": {**shm, **many}}]})
    assert 4096 < len(body) <= 8192
    region = bytearray(4)
    small = Limits(1, 1, "small")
    for _ in range(2):  # refused before and after another model has cached it
        with pytest.raises(InvalidInputError, match="more JSON objects"):
            decode_infer(body, None, lambda n, o, s: memoryview(region)[o : o + s], limits=small)
        decode_infer(body, None, lambda n, o, s: memoryview(region)[o : o + s])
        assert len(PLANS) == 1
    PLANS.clear()


def test_a_plain_json_request_with_a_bad_id_reports_its_errors_in_the_usual_order() -> None:
    PLANS.clear()
    with pytest.raises(BadRequestError, match="'inputs' must be a non-empty list"):
        decode_infer(orjson.dumps({"id": None, "inputs": []}))
    with pytest.raises(BadRequestError, match="'id' must be a string"):
        decode_infer(
            orjson.dumps({"id": None, "inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]})
        )
    PLANS.clear()
