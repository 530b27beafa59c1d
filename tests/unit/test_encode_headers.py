"""The JSON headers of all-binary answers, written once per model, version and output layout
(edged.wire.encode._headers): every answer still carries its own model, version, shapes, types
and sizes, and only answers whose header cannot differ share one."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson

from edged.wire import encode as encoding
from edged.wire.tensors import InferRequest, OutputRequest


def _answer(model: str, arr: np.ndarray, version: str = "1", rid: str = "") -> tuple[dict[str, Any], bytes]:
    req = InferRequest(rid, {}, [OutputRequest("y", binary=True)], True, {})
    body, header_len = encoding.encode_infer(model, req, {"y": arr}, None, version)
    assert header_len is not None
    return orjson.loads(body[:header_len]), body[header_len:]


def test_answers_of_one_layout_share_a_header_and_others_get_their_own() -> None:
    encoding._headers.clear()
    a = np.arange(4, dtype=np.float32).reshape(1, 4)
    first, data = _answer("m", a)
    assert len(encoding._headers) == 1, "the header of an all-binary answer was not kept"
    again, data2 = _answer("m", a * 2)
    assert again == first and data2 == (a * 2).tobytes() and data == a.tobytes()
    cases: list[tuple[str, np.ndarray, str]] = [
        ("other", a, "1"),
        ("m", a, "2"),
        ("m", np.arange(8, dtype=np.float32).reshape(2, 4), "1"),
        ("m", a.astype(np.int64), "1"),
    ]
    for model, arr, version in cases:
        doc, raw = _answer(model, arr, version)
        out = doc["outputs"][0]
        assert (doc["model_name"], doc["model_version"]) == (model, version)
        assert out["shape"] == list(arr.shape) and out["parameters"]["binary_data_size"] == arr.nbytes
        assert out["datatype"] == ("FP32" if arr.dtype == np.float32 else "INT64")
        assert raw == arr.tobytes()


def test_an_answer_with_an_id_is_kept_without_it_and_each_gets_its_own() -> None:
    encoding._headers.clear()
    doc, _ = _answer("m", np.ones((1, 4), np.float32), rid="r-1")
    assert doc["id"] == "r-1"
    assert [b'"id"' in h for h in encoding._headers.values()] == [False]
    doc, _ = _answer("m", np.ones((1, 4), np.float32), rid="r-2")
    assert doc["id"] == "r-2"
    doc, _ = _answer("m", np.ones((1, 4), np.float32))
    assert "id" not in doc
