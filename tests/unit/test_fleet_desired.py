"""Desired-state messages are hostile input: each bad field is refused with its own code, and
the per-device override replaces only the models it names."""

from __future__ import annotations

import json

import pytest

from edged.fleet import desired

SHA = "ab" * 32
LIMITS = {"max_bytes": 4096, "max_models": 4, "max_bundle": 1 << 30}


def doc(**models: dict[str, object]) -> bytes:
    return json.dumps({"models": models}).encode()


def target(**over: object) -> dict[str, object]:
    return {"url": "https://models.example/m.tar", "sha256": SHA, "version": "2.1.0", **over}


def test_a_valid_message_parses_and_an_empty_one_clears() -> None:
    d = desired.parse(doc(m=target(size=10)), **LIMITS)
    assert d is not None and d.models["m"] == desired.Target("https://models.example/m.tar", SHA, "2.1.0", 10)
    assert d.models["m"].key == "2.1.0+" + SHA[:16]
    assert desired.parse(b"", **LIMITS) is None


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (b"x" * 5000, "too_large"),
        (b"{not json", "bad_json"),
        (b'{"models": [], "extra": 1}', "bad_field"),
        (json.dumps({"models": {"m": {**target(), "shell": "rm -rf /"}}}).encode(), "bad_field"),
        (doc(**{"../etc": target()}), "bad_name"),
        (doc(**{"a/+/#": target()}), "bad_name"),
        (doc(m=target(sha256="AB" * 32)), "bad_digest"),
        (doc(m=target(version="latest")), "bad_version"),
        (doc(m=target(url="ftp://host/m.tar")), "bad_url"),
        (doc(m=target(url="file:///etc/passwd")), "bad_url"),
        (doc(m=target(url="relative/path.tar")), "bad_url"),
        (doc(m=target(url="/bundles/m.tar\n")), "bad_url"),
        (doc(m=target(size=2 << 30)), "too_large"),
        (doc(**{f"m{i}": target() for i in range(5)}), "too_many_models"),
    ],
)
def test_hostile_messages_are_refused_with_a_precise_code(payload: bytes, code: str) -> None:
    with pytest.raises(desired.DesiredRefused) as e:
        desired.parse(payload, **LIMITS)
    assert e.value.code == code, e.value.reason


def test_a_device_override_replaces_only_the_models_it_names() -> None:
    group = desired.parse(doc(a=target(version="1.0"), b=target(version="1.0")), **LIMITS)
    device = desired.parse(doc(b=target(version="2.0")), **LIMITS)
    out = desired.effective(group, device)
    assert (out["a"].version, out["b"].version) == ("1.0", "2.0")
    assert desired.effective(None, device) == {"b": device.models["b"]} if device else False
    assert desired.parse(desired.encode(out), **LIMITS) == desired.Desired(out)
