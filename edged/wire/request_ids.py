"""A binary-extension header's request id, kept out of the key its plan is cached under.

Clients that number their requests (tritonclient's ``request_id``, edged.client's) send a new
header each time, the same but for the id's value. Keyed whole, every such request was planned
again and each filled the plan cache, pushing other clients' plans out. So a header with a
top-level ``"id"`` is first cut where its id's value stands: the bytes before and after it are the
key of a *template*, and a later header that matches a template byte for byte around a plain
value (a string without escapes, or an integer) reuses its plan with no JSON parsed at all. A
header no template matches is parsed once, its id popped and the rest written back as the key
(``without_id``); its template is remembered only once a probe shows that the cut is the
top-level id's value (``template_of``).

Keys made here start with a NUL byte, which no JSON document does: a client cannot send one as a
header and reach a plan cached under it.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from edged.errors import BadRequestError

ID_MEMBER = b'"id"'
ID_LESS = b"\x00without id:"  # the rest of a parsed header, written back without its id
_TEMPLATE = b"\x00id template:"  # the bytes around a header's id value
_CUT = b"\x00"  # where the value stood, in a template's key (never in a JSON header)
# The first "id" member followed by a plain value: a string without escapes or control
# characters, or an integer orjson reads exactly (at most 18 digits). Anything else in the id
# (escapes, a float, a longer number) leaves the header to the parsed path.
_ID_VALUE = re.compile(rb'"id"[ \t\n\r]*:[ \t\n\r]*("[^"\\\x00-\x1f]*"|-?(?:0|[1-9][0-9]{0,17}))')
_PROBE = "\x01edged probe"  # a value no client sends, for the template's check
_REFUSED_KEPT = 256  # templates whose probe failed, remembered so that each is probed once


def request_id(rid: Any) -> str:
    """The id of a request as edged answers it: a string, or an integer written as one."""
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        raise BadRequestError("'id' must be a string")
    return str(rid)


def cut(header: bytes) -> tuple[bytes, str, int, int] | None:
    """(the template's key, the id, where its value starts and ends) for a header whose first
    "id" member has a plain value; None for any other header."""
    m = _ID_VALUE.search(header)
    if m is None:
        return None
    start, end = m.span(1)
    token = header[start:end]
    if token[:1] == b'"':
        try:
            rid = token[1:-1].decode("utf-8")
        except UnicodeDecodeError:
            return None  # orjson refuses it too: the parsed path says so
    else:
        rid = str(int(token))
    return _TEMPLATE + header[:start] + _CUT + header[end:], rid, start, end


def without_id(header: bytes) -> tuple[bytes, str, dict[str, Any]] | None:
    """A header with a top-level "id": (the cache key of the rest, the id, the rest parsed).
    None where the header is not such a document, or holds NaN or Infinity (read by the standard
    library, not written back the same): the normal path plans it (and reports what is wrong
    with it)."""
    if b"NaN" in header or b"Infinity" in header:
        return None
    try:
        doc = orjson.loads(header)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(doc, dict) or "id" not in doc:
        return None
    try:
        rid = request_id(doc.pop("id"))
    except BadRequestError:  # planned whole, so that its errors come in their usual order
        return None
    try:
        rest = orjson.dumps(doc)
    except orjson.JSONEncodeError:  # nested deeper than orjson writes (254; it reads 1024)
        return None
    return ID_LESS + rest, rid, doc


class Templates:
    """Which templates were probed and refused, by their keys' hashes (at most _REFUSED_KEPT):
    each costs one more parse, once. A hash shared by two keys costs a template, never an answer."""

    def __init__(self) -> None:
        self._refused: set[int] = set()

    def template_of(self, header: bytes, where: tuple[bytes, str, int, int], rest: dict[str, Any]) -> bytes | None:
        """The template's key when ``where`` is the top-level id's value in ``header``, whose
        document without its id is ``rest``: the header with a probe value put there must parse
        to ``rest`` plus the probe as its id. A cut that falls anywhere else (an "id" nested in
        parameters first, a second top-level "id" after it) changes something else or nothing."""
        key, _, start, end = where
        if hash(key) in self._refused:
            return None
        try:
            probed = orjson.loads(header[:start] + orjson.dumps(_PROBE) + header[end:])
        except orjson.JSONDecodeError:
            probed = None
        if isinstance(probed, dict) and probed.pop("id", None) == _PROBE and probed == rest:
            return key
        if len(self._refused) >= _REFUSED_KEPT:
            self._refused.clear()
        self._refused.add(hash(key))
        return None


TEMPLATES = Templates()
