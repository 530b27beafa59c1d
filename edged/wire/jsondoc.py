"""Strict JSON reading for the wire's documents: an infer request's header, control messages,
generation requests and settings, on every transport.

orjson reads them (strict JSON, fast); a document that orjson refuses and that holds NaN or
Infinity, which Python's json, NumPy and tritonclient write for non-finite values and Triton
accepts, is read again with the standard library.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

from edged.errors import BadRequestError


def load_object(raw: bytes | memoryview, not_object: str, malformed: str = "malformed JSON") -> dict[str, Any]:
    """A strict JSON object (a control message, a generation request, settings), or
    BadRequestError: ``malformed: <orjson's reason>``, or ``not_object`` for any other value."""
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadRequestError(f"{malformed}: {e}") from None
    if not isinstance(doc, dict):
        raise BadRequestError(not_object)
    return doc


# An escaped UTF-16 surrogate (\uD800-\uDFFF), paired or not.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def load_json(header: memoryview | bytes) -> Any:
    """orjson, strict JSON; a document that orjson refuses and that holds NaN or Infinity (which
    Python's json, NumPy and tritonclient write for non-finite values, and Triton accepts) is read
    again with the standard library, which accepts them."""
    try:
        return orjson.loads(header)
    except orjson.JSONDecodeError as e:
        raw = bytes(header)
        if b"NaN" not in raw and b"Infinity" not in raw:
            raise BadRequestError(f"malformed JSON: {e}") from None
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as e2:  # JSONDecodeError, bad UTF-8, too deep, huge ints
            raise BadRequestError(f"malformed JSON: {e2}") from None
        if _SURROGATE_ESCAPE.search(raw) is not None:
            # json takes an escaped lone surrogate, which no answer or error could carry (orjson
            # refuses to write it): refused here, as orjson refuses it. A pair is one character.
            try:
                json.dumps(doc, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:
                raise BadRequestError("malformed JSON: a string holds a lone UTF-16 surrogate") from None
            except RecursionError:  # as deep as json.loads could go: no deeper is written
                raise BadRequestError("malformed JSON: nested too deeply") from None
        return doc
