"""systemd integration: sd_notify, the watchdog, socket activation and journald logging.

The daemon runs on JetPack 5 (systemd 245) up to JetPack 7 (255), with or without the
``systemd-python`` package (the ``systemd`` extra). Everything here works without it: listen fds
fall back to parsing ``$LISTEN_FDS``. Notify is always edged's own: one non-blocking datagram on
``$NOTIFY_SOCKET`` (the whole sd_notify protocol for what edged sends; it passes no fds), because
libsystemd's sd_notify sends with a blocking ``sendmsg``: a manager that stops reading (or a
harness that listens only until READY=1) fills the socket's queue of ``net.unix.max_dgram_qlen``
(10 by default) and the next STATUS= line would freeze the event loop, and with it the daemon.
Outside systemd every call is a cheap no-op that returns False or nothing, so the daemon calls
these helpers unconditionally.

Only messages that systemd 245 understands are sent. ``MONOTONIC_USEC`` with ``RELOADING=1`` is
read by 253+ (Type=notify-reload) and ignored before, which is why it is safe to always send it.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import socket
import stat
import sys
import time
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)


def _optional(name: str) -> ModuleType | None:
    """systemd-python is the optional "systemd" extra; without it the fallbacks below are used."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


_sd_daemon = _optional("systemd.daemon")
_sd_journal = _optional("systemd.journal")

SYSLOG_IDENTIFIER = "edged"
JOURNAL_SOCKET = "/run/systemd/journal/socket"
LISTEN_FDS_START = 3
# LogRecord extras that become journal fields (upper-cased) and plain-text suffixes.
LOG_FIELDS = ("model", "request_id", "phase")

# --- sd_notify --------------------------------------------------------------------------------


def _socket_address(value: str) -> str | None:
    """``$NOTIFY_SOCKET`` as a Python AF_UNIX address; '@' names the abstract namespace."""
    if value.startswith("@"):
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None  # vsock: (253+) and anything else this daemon cannot reach: treated as absent


def _send_datagram(message: str) -> bool:
    """The sd_notify protocol: one datagram, credentials added by the kernel; never waits (a full
    queue raises BlockingIOError)."""
    address = _socket_address(os.environ.get("NOTIFY_SOCKET", ""))
    if address is None:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK) as sock:
        sock.sendto(message.encode("utf-8"), address)
    return True


_queue_full = False  # the manager's queue was full at the last notify: say so once per episode


def notify(*lines: str) -> bool:
    """Send ``KEY=value`` lines to the service manager; False outside systemd or on failure.

    A failed notify never raises nor waits: losing a STATUS= line must not take the daemon down,
    and a lost READY=1 shows up as a start timeout in systemd, which is where an operator looks.
    """
    global _queue_full
    if not lines:
        return False
    message = "\n".join(lines)
    try:
        sent = _send_datagram(message)
    except BlockingIOError:
        if not _queue_full:
            log.warning(
                "sd_notify: the service manager is not reading its socket; dropped: %s", message.replace("\n", " ")
            )
        _queue_full = True
        return False
    except OSError as e:
        log.warning("sd_notify failed (%s): %s", e, message.replace("\n", " "))
        return False
    if _queue_full and sent:
        log.info("sd_notify: the service manager reads its socket again")
    _queue_full = False
    return sent


def _with_status(first: str, text: str) -> bool:
    return notify(first, f"STATUS={text}") if text else notify(first)


def ready(status: str = "") -> bool:
    """READY=1: start-up (or a reload) is complete, every preloaded model is warm."""
    return _with_status("READY=1", status)


def status(text: str) -> bool:
    """STATUS=: one line shown by ``systemctl status`` (build progress, models loaded)."""
    return notify(f"STATUS={text}")


def monotonic_usec() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


def reloading(status: str = "") -> bool:
    """RELOADING=1 at the start of a reload; send ``ready()`` when it is done.

    MONOTONIC_USEC lets systemd 253+ tell this reload from an earlier one; older ones ignore it.
    """
    lines = ["RELOADING=1", f"MONOTONIC_USEC={monotonic_usec()}"]
    if status:
        lines.append(f"STATUS={status}")
    return notify(*lines)


def stopping(status: str = "") -> bool:
    """STOPPING=1: the drain has begun; systemd stops waiting for READY and shows 'deactivating'."""
    return _with_status("STOPPING=1", status)


def extend_timeout(usec: int) -> bool:
    """EXTEND_TIMEOUT_USEC=: give the current start/stop/reload phase ``usec`` more from now.

    An engine build can take minutes; sending this periodically keeps TimeoutStartSec short for a
    warm boot without killing a cold one (systemd 236+).
    """
    if usec <= 0:
        raise ValueError(f"extend_timeout needs a positive number of microseconds, got {usec}")
    return notify(f"EXTEND_TIMEOUT_USEC={int(usec)}")


def watchdog_ping() -> bool:
    return notify("WATCHDOG=1")


def watchdog_interval() -> float | None:
    """WatchdogSec= in seconds when the watchdog is armed for this process, else None.

    Mirrors sd_watchdog_enabled(3), which systemd-python (235) does not wrap: WATCHDOG_USEC set,
    and WATCHDOG_PID absent or this process. Ping at least twice per interval.
    """
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and (not pid.isdigit() or int(pid) != os.getpid()):
        return None
    return int(usec) / 1_000_000


# --- socket activation --------------------------------------------------------------------------


_LISTEN_VARS = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")


def listen_fds() -> list[int]:
    """Descriptors passed by socket activation (edged.socket), or [] when none were.

    The LISTEN_* variables are removed from the environment, as sd_listen_fds(3) does when asked,
    so the build child processes never believe the sockets are theirs. libsystemd unsets only the
    C environment; os.environ is Python's copy, and a child started with env=dict(os.environ)
    would get them back, hence the pop.
    """
    fds = list(_sd_daemon.listen_fds(unset_environment=True)) if _sd_daemon is not None else _listen_fds_fallback()
    for name in _LISTEN_VARS:
        os.environ.pop(name, None)
    return fds


def _listen_fds_fallback() -> list[int]:
    pid = os.environ.get("LISTEN_PID", "")
    count = os.environ.get("LISTEN_FDS", "")
    if not (pid.isdigit() and int(pid) == os.getpid() and count.isdigit()):
        return []
    fds = list(range(LISTEN_FDS_START, LISTEN_FDS_START + int(count)))
    for fd in fds:
        os.set_inheritable(fd, False)  # sd_listen_fds sets FD_CLOEXEC too
    return fds


def under_systemd() -> bool:
    """True when a service manager started this process (or an ancestor that kept its env)."""
    return any(os.environ.get(k) for k in ("INVOCATION_ID", "JOURNAL_STREAM", "NOTIFY_SOCKET"))


def stderr_is_journal() -> bool:
    """stderr is the journal stream systemd connected, per JOURNAL_STREAM in systemd.exec(5)."""
    dev, _, ino = os.environ.get("JOURNAL_STREAM", "").partition(":")
    if not (dev.isdigit() and ino.isdigit()):
        return False
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return stat.S_ISSOCK(st.st_mode) and (st.st_dev, st.st_ino) == (int(dev), int(ino))


# --- logging ----------------------------------------------------------------------------------------

_FIELD_RE = re.compile(r"^[A-Z][A-Z0-9_]{0,63}$")
# Attributes every LogRecord has: JournalHandler passes record.__dict__ as fields, these are noise.
_RECORD_ATTRS = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}
Sender = Callable[..., Any]


def journal_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    """Turn JournalHandler's keyword fields into ones journald keeps.

    JournalHandler passes every LogRecord attribute under its own lower-case name, and journald
    silently drops any field whose name is not upper case: ``extra={"model": "det"}`` would be
    lost. Extras are upper-cased (MODEL=, REQUEST_ID=, PHASE=), the standard record attributes
    dropped, None values skipped.
    """
    out: dict[str, Any] = {}
    for key, value in fields.items():
        if value is None or key in _RECORD_ATTRS:
            continue
        name = key.upper()
        if _FIELD_RE.match(name):
            out.setdefault(name, value)
    return out


def _journal_sender(send: Sender) -> Sender:
    # Positional-only: the record's own "message" and "msg" attributes arrive as keywords too.
    def sender(text: str, /, **fields: Any) -> Any:
        return send(text, **journal_fields(fields))

    return sender


def journal_handler(sender: Sender | None = None) -> logging.Handler:
    """A JournalHandler (SYSLOG_IDENTIFIER=edged) whose extras arrive as journal fields."""
    if _sd_journal is None:
        raise RuntimeError("systemd-python is not installed (pip install 'edged[systemd]')")
    send = sender if sender is not None else _sd_journal.send
    handler: logging.Handler = _sd_journal.JournalHandler(
        SYSLOG_IDENTIFIER=SYSLOG_IDENTIFIER, sender_function=_journal_sender(send)
    )
    handler.setFormatter(logging.Formatter("%(message)s"))
    return handler


def syslog_priority(levelno: int) -> int:
    """A logging level as a syslog priority (journald's PRIORITY=), as JournalHandler maps it."""
    for floor, priority in ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4)):
        if levelno >= floor:
            return priority
    return 6 if levelno >= logging.INFO else 7


class PlainFormatter(logging.Formatter):
    """``time LEVEL logger: message model=... request_id=...``.

    When stderr is the journal stream the time is left out (journald stamps every line) and the
    line starts with ``<N>``, the syslog priority that systemd parses from a service's output.
    """

    def __init__(self, journal_prefix: bool = False) -> None:
        fmt = "%(levelname)s %(name)s: %(message)s"
        super().__init__(fmt if journal_prefix else "%(asctime)s " + fmt)
        self.journal_prefix = journal_prefix

    def formatMessage(self, record: logging.LogRecord) -> str:
        text = super().formatMessage(record)
        extras = [f"{k}={getattr(record, k)}" for k in LOG_FIELDS if getattr(record, k, None)]
        if extras:
            text = f"{text} {' '.join(extras)}"
        if self.journal_prefix:
            text = f"<{syslog_priority(record.levelno)}>{text}"
        return text


def _use_journal() -> bool:
    return _sd_journal is not None and under_systemd() and os.path.exists(JOURNAL_SOCKET)


def setup_logging(level: str) -> logging.Handler:
    """Configure the root logger once: journald under systemd, plain stderr elsewhere.

    Calling it again (on reload, with a new level) replaces the handler it installed before.
    Returns the handler, so tests can look at it.
    """
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    handler: logging.Handler
    if _use_journal():
        handler = journal_handler()
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(PlainFormatter(journal_prefix=stderr_is_journal()))
    handler.set_name("edged")
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == "edged"]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(numeric)
    return handler
