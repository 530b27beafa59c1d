"""What a JSON schema may ask of the grammar it becomes, checked before any grammar is made.

Every transport reads ``response_format`` through ``generation.response_format_from``, which
calls this, so the bounds are the same over HTTP, gRPC and MQTT.
"""

from __future__ import annotations

import re
from typing import Any

from edged.errors import InvalidInputError

# A JSON schema becomes a llama.cpp grammar in which a bound such as ``maxLength: n`` is n nested
# groups, which llama.cpp parses recursively on the slot's thread: a bound in the tens of
# thousands overflows that thread's stack and ends the daemon, whatever the schema's byte size.
# Bounds and nesting far beyond any real schema's are refused before a grammar is made.
MAX_REPEAT = 1000
MAX_SCHEMA_DEPTH = 64
_REPEAT_KEYS = ("minLength", "maxLength", "minItems", "maxItems")
# Keywords llama-cpp-python's schema converter (llama_grammar.json_schema_to_gbnf, 0.3.36) drops
# without a word: a schema asking `"maximum": 150` got an age of 10851. Refused by name rather
# than served unenforced.
_UNENFORCED = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def costly_schema(schema: dict[str, Any]) -> str:
    """Why a ``json_schema`` response format's schema is refused ('' when it is not). Every
    object in it is checked as a schema, values under ``const`` or ``enum`` too: a false alarm
    there is a 400, while telling schemas from values by their keys would let a property named
    ``enum`` by. Iterative, and before the schema is serialised, whose recursion this bounds."""
    stack: list[tuple[Any, str, int]] = [(schema, "", 1)]
    while stack:  # iterative: the nesting is what is being bounded
        node, where, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            return f"nests deeper than {MAX_SCHEMA_DEPTH} levels at {where}"
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            at = f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}" if where else str(key)
            if isinstance(node, dict):
                why = _costly_keyword(key, value)
                if why:
                    return f"{at} {why}"
            if isinstance(value, (dict, list)):
                stack.append((value, at, depth + 1))
    return ""


def _costly_keyword(key: Any, value: Any) -> str:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if key in _UNENFORCED and number:
        return "is not enforced by the grammar (numeric bounds are not served): leave it out and check the value"
    if key in _REPEAT_KEYS and number and value > MAX_REPEAT:
        return f"is {value}; bounds above {MAX_REPEAT} are not served"
    if key == "pattern" and isinstance(value, str):
        counts = sum(max(int(lo), int(hi or 0)) for lo, hi in _QUANTIFIER.findall(value))
        if counts > MAX_REPEAT:
            return f"repeats {counts} times in all; at most {MAX_REPEAT} are served"
    return ""


def refuse_costly_schema(schema: dict[str, Any]) -> None:
    why = costly_schema(schema)
    if why:
        raise InvalidInputError(f"'response_format' schema: {why}")
