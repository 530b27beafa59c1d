"""One-line renderings of a gate's figures for tables and the log (no numpy: the CLI imports
this to print ``edged status``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def describe(gate: Mapping[str, Any] | None) -> str:
    """One line for ``edged build``/``plan`` tables and the log: the verdict, the figures and
    what a mixed-precision search chose."""
    if not gate:
        return "-"
    keys = ("rel_l2", "cosine", "top1", "mask_iou", "det_f1")
    parts = [f"{k}={gate[k]:.4g}" for k in keys if isinstance(gate.get(k), float)]
    search = gate.get("search") or {}
    if search.get("passed"):
        parts.append(f"mixed: {len(search['excluded'])} nodes float, {search['int8_mac_fraction']:.0%} MACs int8")
    elif search:
        parts.append(f"mixed: no pass in {len(search.get('trials', []))} trials")
    return ("pass " if gate.get("passed") else "FAIL ") + " ".join(parts)


def precision_text(precision: str | None, gate: Mapping[str, Any] | None) -> str:
    """``int8 (mixed)`` when a mixed-precision search chose nodes to keep in float."""
    search = (gate or {}).get("search") or {}
    if precision == "int8" and search.get("passed") and search.get("excluded"):
        return "int8 (mixed)"
    return precision or "-"


def ms_text(value: float) -> str:
    """A median in milliseconds with three significant digits, never in exponent form."""
    if value >= 100:
        return f"{value:.0f} ms"
    return f"{value:.3g} ms"


def auto_text(auto: Mapping[str, Any] | None) -> str:
    """One line for ``edged plan``/``status``: each candidate of ``precision = "auto"`` with its
    median and gate, then the choice and why."""
    if not auto or not auto.get("choice"):
        return "-"
    parts = []
    for c in auto.get("candidates", []):
        ms = c.get("median_ms")
        timed = ms_text(ms) if isinstance(ms, (int, float)) else "not timed"
        verdict = c.get("gate") or ("reference" if c.get("precision") == "fp32" else "")
        if not c.get("passed"):
            verdict = c.get("note", "not eligible")
        parts.append(f"{c.get('label', c.get('precision'))} {timed}" + (f" [{verdict}]" if verdict else ""))
    return f"candidates {', '.join(parts)}; chose {auto['choice']['why']}"
