"""Sizes as a config writes them (``"6GiB"``, ``"80%"``) and as a log line reads them."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """``"6GiB"`` → bytes. Raises ValueError with a readable message."""
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise ValueError(f"expected a size such as '512MiB' or '6GiB', got {text!r}")
    return int(float(m.group(1)) * _UNITS[unit])


def parse_budget(text: str, total: int) -> int:
    """A budget is a share of total memory (``"80%"``) or an absolute size."""
    stripped = text.strip()
    if stripped.endswith("%"):
        try:
            pct = float(stripped[:-1])
        except ValueError:
            raise ValueError(f"expected a percentage such as '80%', got {text!r}") from None
        if not 0 < pct <= 100:
            raise ValueError(f"a percentage must be in (0, 100], got {text!r}")
        return int(total * pct / 100)
    return parse_size(stripped)


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover
