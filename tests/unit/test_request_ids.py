"""A numbered client's headers, the same but for the id, are read through the template around the
id's value (edged/wire/request_ids.py): parsed once, then matched byte for byte. Every request
read through a template must decode as the parsed path decodes it (a fresh cache, the same
bytes), ids and errors alike, and a cut that is not the top-level id's value is never a template."""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import orjson
import pytest

from edged.errors import BadRequestError, EdgedError
from edged.wire import decode, encode, request_ids
from edged.wire.decode import decode_infer
from edged.wire.encode import encode_infer
from edged.wire.plans import PLANS
from edged.wire.tensors import InferRequest, OutputRequest
from edged.wire.validate import Limits

INPUT: dict[str, object] = {"name": "x", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": 4}}


pytestmark = pytest.mark.usefixtures("empty_plans")


@pytest.fixture
def parses(calls_of: Any) -> list[tuple[Any, ...]]:
    """The headers the parsed path read (request_ids.without_id, the real one)."""
    return calls_of(decode, "without_id")  # type: ignore[no-any-return]


def _decoded(header: bytes) -> tuple[str, Any]:
    """The request's id and its inputs' layout, or the error it is refused with."""
    try:
        req = decode_infer(header + b"\0" * 4, len(header))
    except BadRequestError as e:
        return "refused", str(e)
    return req.id, sorted((k, v.dtype.str, v.shape) for k, v in req.inputs.items())


def _fresh(header: bytes) -> tuple[str, Any]:
    """The same header decoded with nothing cached: the parsed path alone."""
    kept = list(PLANS._plans.items())
    PLANS.clear()
    try:
        return _decoded(header)
    finally:
        PLANS.clear()
        for key, plan in kept:
            PLANS.put(key, plan)


def test_a_numbered_client_is_parsed_once_then_read_through_its_template(parses: list[tuple[Any, ...]]) -> None:
    # tritonclient writes json.dumps's ", " and ": " (and escapes what is not ASCII: such an id
    # is parsed each time), edged.client orjson's compact form.
    styles = [
        lambda rid: json.dumps({"id": rid, "inputs": [INPUT]}).encode(),
        lambda rid: orjson.dumps({"inputs": [INPUT], "id": rid}),
    ]
    for style, escaped in zip(styles, (1, 0)):
        parses.clear()
        for rid in ("r1", "r2", "", "é 漢字 space", 0, 7, -12, 10**17):
            assert _decoded(style(rid))[0] == str(rid)
        assert len(parses) == 1 + escaped, parses  # the first request of each style
    assert PLANS.distinct() == 1


def test_an_id_that_is_not_a_plain_value_takes_the_parsed_path_with_its_errors(parses: list[tuple[Any, ...]]) -> None:
    assert _decoded(orjson.dumps({"id": "first", "inputs": [INPUT]}))[0] == "first"
    parses.clear()
    template = orjson.dumps({"id": "@", "inputs": [INPUT]})
    for value in (b'"a\\"b"', b'"\\u00e9"', b"12.5", b"1e3", b"true", b"null", b"12345678901234567890", b'"\xff"'):
        header = template.replace(b'"@"', value)
        assert _decoded(header) == _fresh(header), header
    assert len(parses) >= 6  # escapes, floats and the rest were parsed, not matched
    assert _decoded(template.replace(b'"@"', b"12.5"))[0] == "refused"


def test_an_id_nested_before_the_top_level_one_is_never_a_template(parses: list[tuple[Any, ...]]) -> None:
    # The cut finds the nested "id" first; a template made there would answer every later
    # request with the nested value as its id, and the first request's parameters.
    for n in range(4):
        header = orjson.dumps({"parameters": {"id": f"p{n}"}, "id": "top", "inputs": [INPUT]})
        req = decode_infer(header + b"\0" * 4, len(header))
        assert req.id == "top" and req.parameters == {"id": f"p{n}"}
    assert len(parses) == 4


def test_a_second_top_level_id_wins_as_when_parsed(parses: list[tuple[Any, ...]]) -> None:
    # orjson keeps the last of two members of one name: so must every later request.
    for first in ("a", "x", "m"):
        header = b'{"id":"%s","inputs":[%s],"id":"last"}' % (first.encode(), orjson.dumps(INPUT))
        assert _decoded(header)[0] == "last"
    assert len(parses) == 3


def test_ids_read_through_templates_match_the_parsed_path(parses: list[tuple[Any, ...]]) -> None:
    """Seeded: random ids in random headers of three clients, each decoded as a fresh cache
    decodes it."""
    rng = random.Random(20261207)
    alphabet = 'ab"\\é \t\n0-9}{:,'
    clients = [
        (lambda rid: json.dumps({"id": rid, "inputs": [INPUT]}).encode(), lambda rid: json.dumps(rid).encode()),
        (lambda rid: orjson.dumps({"inputs": [INPUT], "parameters": {"k": "id"}, "id": rid}), orjson.dumps),
        (lambda rid: orjson.dumps({"inputs": [dict(INPUT, name="id")], "id": rid}), orjson.dumps),
    ]
    parsed = escaped = 0
    for _ in range(600):
        rid: object = (
            rng.randrange(-(2**63) + 1, 2**63)
            if rng.random() < 0.3
            else "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 8)))
        )
        header_of, token_of = rng.choice(clients)
        header = header_of(rid)
        before = len(parses)
        got = _decoded(header)
        parsed += len(parses) - before
        token = token_of(rid)
        escaped += b"\\" in token or len(token.lstrip(b"-")) > 18  # no plain value: always parsed
        assert got == _fresh(header), header
    # Every request with a plain id but each client's first was matched, not parsed.
    assert escaped <= parsed <= escaped + len(clients), (parsed, escaped)


def test_template_keys_cannot_be_sent_as_headers() -> None:
    header = orjson.dumps({"id": "r", "inputs": [INPUT]})
    _decoded(header)
    where = request_ids.cut(header)
    assert where is not None and PLANS.get(where[0]) is not None
    with pytest.raises(BadRequestError, match="malformed JSON"):
        decode_infer(where[0] + b"\0" * 4, len(where[0]))


def test_an_answers_id_is_written_as_orjson_writes_the_whole_document() -> None:
    """Answer heads are kept without the id and given it last: the bytes must be orjson's for the
    whole document, cached or not, whatever the id holds."""
    results: dict[str, np.ndarray] = {
        "probs": np.arange(4, dtype=np.float32).reshape(1, 4),
        "n": np.array([[1, 2]], np.int64),
    }
    outputs = [OutputRequest("probs", True), OutputRequest("n", True)]
    entries = [
        {"name": "probs", "datatype": "FP32", "shape": [1, 4], "parameters": {"binary_data_size": 16}},
        {"name": "n", "datatype": "INT64", "shape": [1, 2], "parameters": {"binary_data_size": 16}},
    ]
    raw = results["probs"].tobytes() + results["n"].tobytes()
    encode._headers.clear()
    for rid in ("r1", "", 'q"uote\\ \n\x01', "é漢字", "", "7", "r1"):
        doc: dict[str, object] = {"model_name": "m", "model_version": "1", "outputs": entries}
        if rid:
            doc["id"] = rid
        want = orjson.dumps(doc)
        body, header_length = encode_infer("m", InferRequest(rid, {}, outputs, True, {}), results)
        assert (body[:header_length], body[header_length:]) == (want, raw), rid
    # No output asked for: a plain JSON answer, with its id.
    body, header_length = encode_infer("m", InferRequest("r9", {}, [], True, {}), results)
    assert header_length is None and orjson.loads(body) == {
        "model_name": "m",
        "model_version": "1",
        "outputs": [],
        "id": "r9",
    }


def test_an_id_read_through_a_template_is_held_to_the_json_limits() -> None:
    """A template compares every byte but the id's value, so a request matched through one is
    held to server.max_json and to the model's object count as a fresh decode holds it."""

    def request(rid: str, limits: Limits) -> str:
        head = orjson.dumps({"id": rid, "inputs": [INPUT]})
        try:
            return decode_infer(head + b"\0" * 4, len(head), limits=limits).id
        except EdgedError as e:
            return type(e).__name__

    for limits, long_id, refusal in [
        (Limits(json_bytes=200, model="m"), "z" * 3000, "PayloadTooLargeError"),
        (Limits(inputs=1, outputs=1, model="m"), "{" * 5000, "InvalidInputError"),
    ]:
        PLANS.clear()
        assert request("a", limits) == "a" and request("b", limits) == "b"  # the template, then checked
        assert request(long_id, limits) == refusal
        PLANS.clear()
        assert request(long_id, limits) == refusal  # as a fresh decode refuses it


def test_a_string_holding_a_lone_surrogate_is_refused_where_nan_is_read() -> None:
    """A document holding NaN is read by Python's json, which takes an escaped lone surrogate
    that no answer could carry (orjson refuses to write it): refused as malformed, where a
    proper pair is read as its character."""
    doc = b'{"id":"%s","inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[NaN]}]}'
    with pytest.raises(BadRequestError, match="surrogate"):
        decode_infer(doc % b"\\ud800", None)
    with pytest.raises(BadRequestError, match="surrogate"):
        decode_infer(doc % b"a\\udc00", None)
    req = decode_infer(doc % b"\\ud83d\\ude00", None)
    assert req.id == "\U0001f600"
    assert np.isnan(req.inputs["x"]).all()
    assert orjson.loads(encode_infer("m", req, {"y": np.zeros(1, np.float32)})[0])["id"] == "\U0001f600"
