"""edged.host.systemd against a real AF_UNIX datagram socket standing in for systemd's notify socket.

Notify is edged's own non-blocking datagram sender (libsystemd's sd_notify blocks on a full
queue); socket activation runs twice, through systemd-python and through the fallback parser.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from edged.host import systemd as sd
from tests.helpers import unavailable

HAS_SYSTEMD_PYTHON = sd._sd_daemon is not None
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Datagram:
    text: str
    pid: int
    uid: int

    def fields(self) -> dict[str, str]:
        return dict(line.split("=", 1) for line in self.text.splitlines())


class NotifyReceiver:
    """The service manager's end: a bound datagram socket that asks for sender credentials,
    as systemd does to decide whether NotifyAccess= lets a message in."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)

    def recv(self, timeout: float = 5.0) -> Datagram:
        self.sock.settimeout(timeout)
        data, ancdata, _, _ = self.sock.recvmsg(65536, socket.CMSG_SPACE(12))
        pid = uid = -1
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid, uid, _gid = struct.unpack("3i", payload[:12])
        return Datagram(data.decode(), pid, uid)

    def assert_empty(self) -> None:
        self.sock.setblocking(False)
        with pytest.raises(BlockingIOError):
            self.sock.recv(65536)


@pytest.fixture(params=["systemd-python", "fallback"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which sender notify() uses; the fallback is forced by hiding systemd-python."""
    if request.param == "fallback":
        monkeypatch.setattr(sd, "_sd_daemon", None)
    elif not HAS_SYSTEMD_PYTHON:
        unavailable("systemd-python is not installed (pip install 'edged[systemd]')")
    return str(request.param)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in (
        "NOTIFY_SOCKET",
        "WATCHDOG_USEC",
        "WATCHDOG_PID",
        "LISTEN_FDS",
        "LISTEN_PID",
        "LISTEN_FDNAMES",
        "INVOCATION_ID",
        "JOURNAL_STREAM",
    ):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def receiver(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> Iterator[NotifyReceiver]:
    address = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(address)
        clean_env.setenv("NOTIFY_SOCKET", address)
        yield NotifyReceiver(sock)


@pytest.fixture
def abstract_receiver(clean_env: pytest.MonkeyPatch) -> Iterator[NotifyReceiver]:
    name = f"edged-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        clean_env.setenv("NOTIFY_SOCKET", "@" + name)
        yield NotifyReceiver(sock)


# --- notify ------------------------------------------------------------------------------------


def test_ready_with_status_is_one_datagram_from_this_process(receiver: NotifyReceiver) -> None:
    assert sd.ready("3 models warm") is True
    got = receiver.recv()
    assert got.text == "READY=1\nSTATUS=3 models warm"
    # systemd's NotifyAccess=main accepts a message only when this pid is the service's main pid.
    assert (got.pid, got.uid) == (os.getpid(), os.getuid())


def test_every_helper_sends_its_protocol_line(receiver: NotifyReceiver) -> None:
    cases: list[tuple[Callable[[], bool], str]] = [
        (sd.ready, "READY=1"),
        (lambda: sd.status("building detector 40%"), "STATUS=building detector 40%"),
        (sd.stopping, "STOPPING=1"),
        (lambda: sd.stopping("draining"), "STOPPING=1\nSTATUS=draining"),
        (lambda: sd.extend_timeout(90_000_000), "EXTEND_TIMEOUT_USEC=90000000"),
        (sd.watchdog_ping, "WATCHDOG=1"),
        (lambda: sd.notify("STATUS=a", "ERRNO=5"), "STATUS=a\nERRNO=5"),
    ]
    for call, expected in cases:
        assert call() is True
        assert receiver.recv().text == expected
    receiver.assert_empty()


def test_reloading_carries_the_monotonic_clock(receiver: NotifyReceiver) -> None:
    before = sd.monotonic_usec()
    assert sd.reloading("reloading config") is True
    after = sd.monotonic_usec()
    fields = receiver.recv().fields()
    assert fields["RELOADING"] == "1"
    assert fields["STATUS"] == "reloading config"
    # systemd 253+ compares this with its own CLOCK_MONOTONIC to order reload notifications.
    assert before <= int(fields["MONOTONIC_USEC"]) <= after


def test_abstract_namespace_socket(abstract_receiver: NotifyReceiver) -> None:
    assert sd.status("abstract") is True
    assert abstract_receiver.recv().text == "STATUS=abstract"


def test_outside_systemd_everything_is_a_no_op(clean_env: pytest.MonkeyPatch) -> None:
    assert sd.ready("x") is False
    assert sd.watchdog_ping() is False
    assert sd.notify() is False
    assert sd.under_systemd() is False


def test_unreachable_socket_returns_false_and_warns(
    tmp_path: Path, clean_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    clean_env.setenv("NOTIFY_SOCKET", str(tmp_path / "gone.sock"))
    with caplog.at_level(logging.WARNING, logger="edged.host.systemd"):
        assert sd.ready() is False
    assert "sd_notify failed" in caplog.text


def test_addresses_it_cannot_reach_are_ignored(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("NOTIFY_SOCKET", "vsock:2:1234")
    assert sd.ready() is False


def test_a_manager_that_stops_reading_never_blocks_the_sender(
    receiver: NotifyReceiver, caplog: pytest.LogCaptureFixture
) -> None:
    """Its queue (net.unix.max_dgram_qlen) fills; then notify drops, says so once, and returns at
    once, where libsystemd's blocking sendmsg would freeze the daemon's event loop."""
    results: list[bool] = []

    def flood() -> None:
        results.extend(sd.status(f"line {i}") for i in range(600))

    with caplog.at_level(logging.INFO, logger="edged.host.systemd"):
        sender = threading.Thread(target=flood, daemon=True)
        sender.start()
        sender.join(timeout=30)
        assert not sender.is_alive(), "notify blocked on a full queue"
        assert results[0] is True and results[-1] is False
        assert caplog.text.count("not reading its socket") == 1
        # The manager catches up, reading all that is queued (the sender has returned): the next
        # line goes through, and that is said too.
        while True:
            try:
                receiver.recv(timeout=0)
            except BlockingIOError:
                break
        assert sd.status("again") is True
    assert "reads its socket again" in caplog.text
    assert receiver.recv().text == "STATUS=again"


def test_extend_timeout_rejects_non_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        sd.extend_timeout(0)


# --- watchdog, environment ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        ("5000000", None, 5.0),
        ("5000000", "self", 5.0),
        ("5000000", "1", None),  # armed for another process (a parent that exec'd us keeps it)
        ("0", None, None),
        ("abc", None, None),
        (None, None, None),
    ],
)
def test_watchdog_interval(
    clean_env: pytest.MonkeyPatch, usec: str | None, pid: str | None, expected: float | None
) -> None:
    if usec is not None:
        clean_env.setenv("WATCHDOG_USEC", usec)
    if pid is not None:
        clean_env.setenv("WATCHDOG_PID", str(os.getpid()) if pid == "self" else pid)
    assert sd.watchdog_interval() == expected


@pytest.mark.parametrize("var", ["INVOCATION_ID", "JOURNAL_STREAM", "NOTIFY_SOCKET"])
def test_under_systemd(clean_env: pytest.MonkeyPatch, var: str) -> None:
    assert sd.under_systemd() is False
    clean_env.setenv(var, "x")
    assert sd.under_systemd() is True


# --- socket activation ---------------------------------------------------------------------------

_LISTEN_CHILD = """
import os, socket, sys
from edged.host import systemd as sd
from tests.helpers import unavailable
if sys.argv[1] == "fallback":
    sd._sd_daemon = None
os.dup2(int(sys.argv[2]), 3)  # systemd passes the first socket as fd 3
os.environ["LISTEN_PID"] = str(os.getpid()) if sys.argv[3] == "self" else "1"
fds = sd.listen_fds()
flags = [os.get_inheritable(fd) for fd in fds]
kinds = [socket.socket(fileno=fd).type == socket.SOCK_STREAM for fd in fds]
left = sorted(k for k in os.environ if k.startswith("LISTEN_"))
print(fds, flags, kinds, left)
"""


@pytest.mark.parametrize(("owner", "expected"), [("self", "[3] [False] [True] []"), ("other", "[] [] [] []")])
def test_listen_fds(path: str, clean_env: pytest.MonkeyPatch, owner: str, expected: str) -> None:
    """In a child process, because sd_listen_fds takes over fds 3.. of the caller."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        env = dict(os.environ, LISTEN_FDS="1", LISTEN_FDNAMES="edged.socket", PYTHONPATH=str(REPO))
        out = subprocess.run(
            [sys.executable, "-c", _LISTEN_CHILD, path, str(listener.fileno()), owner],
            env=env,
            pass_fds=[listener.fileno()],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert out.returncode == 0, out.stderr
    # The fds are close-on-exec and LISTEN_* is gone, so a build child never inherits them.
    assert out.stdout.strip() == expected


# --- logging -----------------------------------------------------------------------------------


@pytest.fixture
def root_logger() -> Iterator[logging.Logger]:
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    yield root
    for h in root.handlers[:]:
        if h.get_name() == "edged":
            root.removeHandler(h)
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def test_plain_logging_appends_fields(
    clean_env: pytest.MonkeyPatch, root_logger: logging.Logger, capsys: pytest.CaptureFixture[str]
) -> None:
    handler = sd.setup_logging("info")
    assert isinstance(handler.formatter, sd.PlainFormatter)
    log = logging.getLogger("edged.test")
    log.info("loaded", extra={"model": "detector", "request_id": "r-17"})
    log.debug("hidden")
    log.warning("plain")
    # Only this logger's lines: garbage collection may log for other tests meanwhile.
    lines = [ln for ln in capsys.readouterr().err.splitlines() if " edged.test: " in ln]
    assert len(lines) == 2
    assert lines[0].endswith("INFO edged.test: loaded model=detector request_id=r-17")
    assert lines[1].endswith("WARNING edged.test: plain")


def test_setup_logging_replaces_its_own_handler(clean_env: pytest.MonkeyPatch, root_logger: logging.Logger) -> None:
    sd.setup_logging("info")
    sd.setup_logging("debug")
    assert [h.get_name() for h in root_logger.handlers].count("edged") == 1
    assert root_logger.level == logging.DEBUG
    with pytest.raises(ValueError, match="unknown log level"):
        sd.setup_logging("loud")


def test_journal_stream_lines_carry_a_priority_prefix() -> None:
    fmt = sd.PlainFormatter(journal_prefix=True)
    rec = logging.LogRecord("edged.x", logging.WARNING, __file__, 1, "slow", (), None)
    rec.phase = "warmup"
    # systemd reads "<4>" as PRIORITY=4; journald stamps the time, so none is written.
    assert fmt.format(rec) == "<4>WARNING edged.x: slow phase=warmup"


def test_stderr_is_journal_compares_device_and_inode(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    a, b = socket.socketpair()
    with a, b, os.fdopen(os.dup(a.fileno()), "w") as stream:
        clean_env.setattr(sys, "stderr", stream)
        st = os.fstat(a.fileno())
        clean_env.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        assert sd.stderr_is_journal() is True
        clean_env.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino + 1}")
        assert sd.stderr_is_journal() is False


@pytest.fixture
def _systemd_journal() -> None:
    if sd._sd_journal is None:
        unavailable("systemd-python is not installed (pip install 'edged[systemd]')")


needs_journal = pytest.mark.usefixtures("_systemd_journal")


@needs_journal
def test_journal_handler_turns_extras_into_journal_fields() -> None:
    sent: list[tuple[str, dict[str, object]]] = []
    handler = sd.journal_handler(sender=lambda msg, **fields: sent.append((msg, fields)))
    log = logging.getLogger("edged.test.journal")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("slow %s", "x", extra={"model": "det", "request_id": "r1", "phase": "infer"})
    finally:
        log.removeHandler(handler)
        log.propagate = True
    ((msg, fields),) = sent
    assert msg == "slow x"
    assert fields["MODEL"] == "det"
    assert fields["REQUEST_ID"] == "r1"
    assert fields["PHASE"] == "infer"
    assert fields["SYSLOG_IDENTIFIER"] == "edged"
    assert fields["PRIORITY"] == "4"
    assert fields["LOGGER"] == "edged.test.journal"
    # journald drops lower-case names; none are sent, nor the LogRecord's own attributes.
    assert all(k == k.upper() for k in fields)
    assert "LEVELNAME" not in fields and "MSG" not in fields


def test_journal_fields_keeps_only_valid_names() -> None:
    fields = sd.journal_fields(
        {"PRIORITY": "6", "model": "m", "bad-name": 1, "_trusted": 2, "phase": None, "name": "x"}
    )
    assert fields == {"PRIORITY": "6", "MODEL": "m"}


@needs_journal
def test_setup_logging_uses_journald_under_systemd(
    clean_env: pytest.MonkeyPatch, root_logger: logging.Logger, tmp_path: Path
) -> None:
    journal_socket = tmp_path / "journal.sock"
    journal_socket.touch()
    clean_env.setattr(sd, "JOURNAL_SOCKET", str(journal_socket))
    clean_env.setenv("INVOCATION_ID", uuid.uuid4().hex)
    handler = sd.setup_logging("info")
    assert type(handler).__name__ == "JournalHandler"
    journal_socket.unlink()  # journald not running: stay on stderr, which systemd captures
    assert isinstance(sd.setup_logging("info").formatter, sd.PlainFormatter)
