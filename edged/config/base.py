"""What every config table shares: immutability, unknown keys refused, the value types."""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec

DEFAULT_CONFIG = "/etc/edged/edged.toml"
DEFAULT_CACHE = "/var/cache/edged/engines"

Backend = Literal["auto", "onnxruntime", "tensorrt", "llama"]
# "auto": every precision the backend can build that passes the gate is timed; the fastest serves.
Precision = Literal["auto", "fp32", "fp16", "int8"]
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]


class Table(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Every config table: immutable, and an unknown key is an error."""
