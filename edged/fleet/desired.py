"""Desired-state messages: what a group of devices (and, overriding it, one device) should serve.

A message is untrusted input from the broker: anyone who may publish on the topic can send one.
It is bounded in size before it is parsed, decoded into a strict schema (unknown fields are
refused, so a misspelt key is an error and not a silent default), and every field is checked
before anything acts on it: model names safe as topic levels and file names, a URL edged may
fetch (HTTP(S), or an absolute local path), a SHA-256 digest, a PEP 440 version, a size within
the bundle limit. A refused message changes nothing and its reason is reported.

    {"models": {"det": {"url": "https://models.example/det-2.1.0.tar",
                        "sha256": "…64 hex…", "version": "2.1.0", "size": 48211968}},
     "rollout": "det-2.1.0", "issued": 1767350000.0}

The per-device message has the same shape; a model it names replaces the group's entry for that
model on that device (the controller's staged rollout uses it), the others follow the group.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Mapping
from typing import Annotated

import msgspec
from packaging.version import InvalidVersion, Version

from edged.fleet.protocol import NAME_RE

SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
MAX_URL = 2048
MAX_VERSION = 64


class DesiredRefused(Exception):
    """A desired-state message edged will not act on: ``code`` is stable, ``reason`` says why."""

    def __init__(self, reason: str, code: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code


class Target(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One model's desired bundle."""

    url: Annotated[str, msgspec.Meta(max_length=MAX_URL)]
    sha256: str
    version: Annotated[str, msgspec.Meta(max_length=MAX_VERSION)]
    size: Annotated[int, msgspec.Meta(ge=0)] = 0  # 0: not announced (the limit still applies)

    @property
    def key(self) -> str:
        """What identifies this desired version: a refusal or a rollback blocks exactly this."""
        return f"{self.version}+{self.sha256[:16]}"


class Desired(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    models: dict[str, Target] = msgspec.field(default_factory=dict)
    rollout: Annotated[str, msgspec.Meta(max_length=128)] = ""
    issued: float = 0.0


_decoder = msgspec.json.Decoder(Desired)


def parse(payload: bytes, max_bytes: int, max_models: int, max_bundle: int) -> Desired | None:
    """The message, checked; None for an empty payload (a cleared retained message)."""
    if not payload:
        return None
    if len(payload) > max_bytes:
        raise DesiredRefused(f"the message has {len(payload)} bytes, over the limit of {max_bytes}", "too_large")
    try:
        doc = _decoder.decode(payload)
    except msgspec.ValidationError as e:
        raise DesiredRefused(f"not a desired-state document: {e}", "bad_field") from None
    except msgspec.DecodeError as e:
        raise DesiredRefused(f"not JSON: {e}", "bad_json") from None
    if len(doc.models) > max_models:
        raise DesiredRefused(f"{len(doc.models)} models, over the limit of {max_models}", "too_many_models")
    for name, target in doc.models.items():
        check_target(name, target, max_bundle)
    return doc


def check_target(name: str, t: Target, max_bundle: int) -> None:
    if not NAME_RE.match(name):
        raise DesiredRefused(f"{name[:80]!r} cannot name a model (letters, digits, '_', '.', '-')", "bad_name")
    if not SHA256_RE.match(t.sha256):
        raise DesiredRefused(f"models.{name}.sha256: expected 64 lowercase hex digits", "bad_digest")
    version_of(t.version, f"models.{name}.version")
    if t.size > max_bundle:
        raise DesiredRefused(f"models.{name}.size: {t.size} bytes, over the bundle limit of {max_bundle}", "too_large")
    check_url(t.url, f"models.{name}.url")


def version_of(text: str, where: str) -> Version:
    try:
        return Version(text)
    except InvalidVersion:
        raise DesiredRefused(
            f"{where}: {text[:80]!r} is not a version (PEP 440, such as 2.1.0)", "bad_version"
        ) from None


def check_url(url: str, where: str) -> None:
    if "\0" in url or any(ord(c) < 0x20 for c in url):
        raise DesiredRefused(f"{where}: control characters in the URL", "bad_url")
    if url.startswith("/"):
        return  # a local path (a shared volume, a USB stick)
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise DesiredRefused(f"{where}: only http(s) URLs and absolute paths are fetched, not {url[:80]!r}", "bad_url")


def effective(group: Desired | None, device: Desired | None) -> dict[str, Target]:
    """The models this device should serve: the group's, with the device's entries over them."""
    out: dict[str, Target] = dict(group.models) if group is not None else {}
    if device is not None:
        out.update(device.models)
    return out


def encode(models: Mapping[str, Target], rollout: str = "", issued: float = 0.0) -> bytes:
    return msgspec.json.encode(Desired(dict(models), rollout, issued))
