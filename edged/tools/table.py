"""Plain-text tables for the command line (``edged status``, ``plan``, ``build``, ``top``).

Its own module so that every command can print one without importing another command's module.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, TextIO


def table_lines(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """Left-aligned columns two spaces apart, a dashed rule under the header."""
    cells = [list(map(str, header))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = []
    for i, row in enumerate(cells):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def print_table(header: Sequence[str], rows: Sequence[Sequence[Any]], out: TextIO | None = None) -> None:
    stream = out if out is not None else sys.stdout
    for line in table_lines(header, rows):
        stream.write(line + "\n")
