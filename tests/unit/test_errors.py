"""The wire table: one code per fault class, the same on every transport."""

from __future__ import annotations

from edged import errors
from edged.client import raise_for


def test_every_code_is_unique_and_has_a_real_status() -> None:
    table = errors.wire_codes()
    assert {"bad_request", "invalid_input", "payload_too_large", "model_not_found", "busy"} <= set(table)
    for code, entry in table.items():
        assert entry.code == code == entry.cls.code
        assert 400 <= entry.http_status <= 599, code
        assert entry.meaning
    # Each class owns its code: a subclass that forgot to set one would share its parent's.
    classes: list[type[errors.EdgedError]] = [errors.EdgedError]
    seen: dict[str, type[errors.EdgedError]] = {}
    while classes:
        cls = classes.pop()
        assert cls.code not in seen, f"{cls.__name__} reuses {seen.get(cls.code)}'s code {cls.code!r}"
        seen[cls.code] = cls
        classes.extend(cls.__subclasses__())


def test_the_client_maps_every_code_back_to_its_class() -> None:
    for code, entry in errors.wire_codes().items():
        try:
            raise_for(entry.http_status, b'{"error": "x", "code": "%s"}' % code.encode())
        except errors.EdgedError as e:
            assert type(e) is entry.cls, code
        else:
            raise AssertionError(f"{code}: no exception")
