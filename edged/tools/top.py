"""``edged top``: a live terminal view of the daemon, refreshed from ``/v2/edged/status``.

Plain ANSI redraws on the alternate screen, no curses: it works over SSH in any terminal that
speaks VT100, and every line is cut to the terminal's width (80 columns is the design case).
``--once`` prints one frame without escapes, for scripts and logs. Requests per second are the
difference of the daemon's request counts between two refreshes.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import sys
import termios
import time
import tty
from collections.abc import Iterator, Mapping
from typing import Any, Protocol, TextIO

from edged.config import format_size
from edged.errors import EdgedError
from edged.serving.states import ModelState

# Fixed columns after the model name: state, precision, queue, p50, p99, req/s, backend.
_COLUMNS: tuple[tuple[str, int, str], ...] = (
    ("STATE", 9, "<"),
    ("PREC", 4, "<"),
    ("QUEUE", 5, ">"),
    ("P50 ms", 8, ">"),
    ("P99 ms", 8, ">"),
    ("REQ/S", 7, ">"),
    ("BACKEND", 11, "<"),
)
_MIN_NAME = 8

ENTER, LEAVE = "\x1b[?1049h\x1b[?25l", "\x1b[?25h\x1b[?1049l"  # alternate screen, cursor hidden
HOME, CLEAR_LINE, CLEAR_BELOW = "\x1b[H", "\x1b[K", "\x1b[J"


class StatusSource(Protocol):
    def status(self) -> dict[str, Any]: ...


class Rates:
    """Requests per second per model, from the counts of two successive refreshes."""

    def __init__(self) -> None:
        self._last: tuple[float, dict[str, int]] | None = None

    def update(self, models: Mapping[str, Mapping[str, Any]], now: float) -> dict[str, float | None]:
        counts = {name: int(m.get("requests") or 0) for name, m in models.items()}
        last, self._last = self._last, (now, counts)
        if last is None or now <= last[0]:
            return dict.fromkeys(counts)
        dt = now - last[0]
        return {n: (c - last[1][n]) / dt if n in last[1] and c >= last[1][n] else None for n, c in counts.items()}


def render(
    status: Mapping[str, Any], rates: Mapping[str, float | None], width: int = 80, height: int = 24, clock: str = ""
) -> list[str]:
    """One frame as lines, each at most ``width`` characters; at most ``height`` lines."""
    lines = [_header(status, clock, width), _memory(status.get("memory", {}), width)]
    lines.append("")
    model_lines = _models(status.get("models", {}), rates, width)
    build_lines = _builds(status.get("builds", []), width)
    room = max(height - len(lines) - len(build_lines), 3)
    if len(model_lines) > room:
        hidden = len(model_lines) - room + 1
        model_lines = [*model_lines[: room - 1], f"... {hidden} more (widen or heighten the terminal)"]
    lines += model_lines + build_lines
    return [_cut(line, width) for line in lines[:height]]


def _header(st: Mapping[str, Any], clock: str, width: int) -> str:
    state = "ready" if st.get("ready") else "NOT READY"
    left = f"edged {st.get('version', '?')}  {state}  up {_duration(st.get('uptime_s') or 0)}  {st.get('status', '')}"
    if clock and len(left) + 2 + len(clock) <= width:
        return left.ljust(width - len(clock)) + clock
    return left


def _memory(mem: Mapping[str, Any], width: int) -> str:
    budget, used = int(mem.get("budget_bytes") or 0), int(mem.get("used_bytes") or 0)
    share = used / budget if budget > 0 else 0.0
    text = f"memory ({mem.get('source', '?')}): used {format_size(used)} of {format_size(budget)} budget"
    text += f" ({share * 100:.0f}%)"
    bar = width - len(text) - 3
    if bar >= 10:
        text += " " + _bar(share, min(bar, 30))
    return text


def _models(models: Mapping[str, Mapping[str, Any]], rates: Mapping[str, float | None], width: int) -> list[str]:
    fixed = sum(w + 1 for _, w, _ in _COLUMNS)
    name_w = max(_MIN_NAME, min(max((len(n) for n in models), default=_MIN_NAME), width - fixed))
    head = " ".join([f"{'MODEL':<{name_w}}", *(f"{t:{a}{w}}" for t, w, a in _COLUMNS)])
    lines = [head.rstrip()]
    for name, m in models.items():
        rate = rates.get(name)
        cells = (
            m.get("state", "?"),
            m.get("precision") or "-",
            str(m.get("queue", 0)),
            _ms(m.get("p50_ms")),
            _ms(m.get("p99_ms")),
            "-" if rate is None else f"{rate:.1f}",
            m.get("backend") or "-",
        )
        row = [f"{_cut(name, name_w):<{name_w}}"]
        row += [f"{_cut(str(c), w):{a}{w}}" for c, (_, w, a) in zip(cells, _COLUMNS)]
        lines.append(" ".join(row).rstrip())
        state = ModelState.named(m.get("state"))
        if m.get("reason") and not (state is not None and state.serving):  # only why a model does not serve
            lines.append(f"  {m['reason']}")
    return lines


def _builds(builds: list[Mapping[str, Any]], width: int) -> list[str]:
    if not builds:
        return []
    lines = ["", "builds in progress:"]
    for b in builds:
        fraction = b.get("fraction")
        progress = "" if fraction is None else f"{_bar(float(fraction), 20)} {float(fraction) * 100:3.0f}%  "
        lines.append(f"  {b.get('model', '?')}: {progress}{b.get('phase', '')}  {_duration(b.get('seconds') or 0)}")
    return lines


def _bar(fraction: float, width: int) -> str:
    inner = width - 2
    filled = round(max(0.0, min(1.0, fraction)) * inner)
    return "[" + "#" * filled + "." * (inner - filled) + "]"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _duration(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{seconds:.0f}s" if seconds >= 10 else f"{seconds:.1f}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "~"


# --- the loop -------------------------------------------------------------------------------------


def run_top(client: StatusSource, interval: float = 1.0, once: bool = False, out: TextIO = sys.stdout) -> int:
    rates = Rates()
    if once:
        # Two samples an interval apart, so the one frame has request rates too.
        rates.update(client.status()["models"], time.monotonic())
        time.sleep(interval)
        st = client.status()
        size = shutil.get_terminal_size((80, 24))
        frame = render(st, rates.update(st["models"], time.monotonic()), size.columns, 10_000)
        out.write("\n".join(frame) + "\n")
        return 0
    with _screen(out), _keys() as key_fd:
        while True:
            _draw(client, rates, out)
            if _quit_pressed(key_fd, interval):
                return 0


def _draw(client: StatusSource, rates: Rates, out: TextIO) -> None:
    size = shutil.get_terminal_size((80, 24))
    clock = time.strftime("%H:%M:%S")
    try:
        st = client.status()
        # One column and one line spare: writing the last column or line makes terminals wrap or scroll.
        lines = render(st, rates.update(st["models"], time.monotonic()), size.columns - 1, size.lines - 1, clock)
    except (OSError, ValueError, EdgedError) as e:  # the daemon restarts or stops: keep trying, say so
        lines = [_cut(f"edged: no status ({e}); retrying every refresh", size.columns - 1), "", "q quits"]
    out.write(HOME + "".join(line + CLEAR_LINE + "\n" for line in lines) + CLEAR_BELOW)
    out.flush()


@contextlib.contextmanager
def _screen(out: TextIO) -> Iterator[None]:
    out.write(ENTER)
    out.flush()
    try:
        yield
    except KeyboardInterrupt:
        pass  # Ctrl-C is the other way out
    finally:
        out.write(LEAVE)
        out.flush()


@contextlib.contextmanager
def _keys() -> Iterator[int | None]:
    """stdin in cbreak mode (keys arrive one by one, unechoed) when it is a terminal."""
    fd = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else None
    if fd is None:
        yield None
        return
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield fd
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _quit_pressed(fd: int | None, timeout: float) -> bool:
    """Wait up to ``timeout`` for a key; True for q or Q."""
    if fd is None:
        time.sleep(timeout)
        return False
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        data = os.read(fd, 32)
        if b"q" in data.lower():
            return True
        if not data:  # the terminal went away: Ctrl-C or a signal ends us now
            time.sleep(max(deadline - time.monotonic(), 0))
    return False
