"""The client reads what edged writes, non-finite numbers included."""

from __future__ import annotations

import math

import numpy as np

from edged.client import decode_response
from edged.wire.decode import InferRequest, encode_infer


def test_non_finite_json_outputs_reach_the_client() -> None:
    y = np.array([[1.0, np.nan, np.inf, -np.inf]], np.float32)
    body, header_len = encode_infer("m", InferRequest(), {"y": y}, None)
    assert header_len is None and b'"NaN","Infinity","-Infinity"' in body
    got = decode_response(body, None)["y"]
    assert got[0, 0] == 1.0 and math.isnan(got[0, 1]) and got[0, 2] == np.inf and got[0, 3] == -np.inf
