"""The command line's errors and ``edged top``, run as a user runs them: ``python -m edged`` in a
subprocess, against a real daemon, and ``edged top`` on a pseudo-terminal of 80x24."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from edged.paths import DEFAULT_SOCKET
from edged.tools.top import ENTER, LEAVE
from tests.helpers import DaemonProcess, unavailable, wait_for, write_config

pytestmark = pytest.mark.integration

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("EDGED_SOCKET", "EDGED_CONFIG")}
    return subprocess.run(
        [sys.executable, "-m", "edged", *args], capture_output=True, text=True, env={**base, **(env or {})}, timeout=60
    )


@pytest.fixture
def tiny_daemon(daemon_factory: Callable[..., DaemonProcess], model_dir: Path) -> DaemonProcess:
    return daemon_factory(
        {
            "tiny": {"path": str(model_dir / "tiny.onnx"), "backend": "onnxruntime"},
            "spare": {"path": str(model_dir / "tiny_b.onnx"), "backend": "onnxruntime", "preload": "lazy"},
        }
    ).start()


# --- "cannot reach" names the socket and where it came from ------------------------------------


def test_unreachable_names_the_socket_and_its_source(tmp_path: Path) -> None:
    missing = str(tmp_path / "nothing.sock")
    out = cli("status", "--socket", missing)
    assert out.returncode == 1
    assert f"cannot reach the daemon at {missing} (from --socket): no such socket" in out.stderr
    out = cli("models", env={"EDGED_SOCKET": missing})
    assert out.returncode == 1 and f"at {missing} (from $EDGED_SOCKET)" in out.stderr
    cfg = write_config(tmp_path / "edged.toml", {"server": {"socket": missing}})
    out = cli("health", "--config", str(cfg))
    assert out.returncode == 1 and f"at {missing} (from [server] socket in {cfg})" in out.stderr
    out = cli("top", "--once", "--config", str(cfg))
    assert out.returncode == 1 and f"at {missing} (from [server] socket in {cfg})" in out.stderr
    out = cli("infer", "tiny", "--input", "x=whatever.npy", "--socket", missing)
    assert out.returncode == 2 and "no such file whatever.npy" in out.stderr  # the input first


def test_the_default_socket_says_it_is_the_default(tmp_path: Path) -> None:
    if os.path.exists(DEFAULT_SOCKET):
        unavailable(f"{DEFAULT_SOCKET} exists on this machine: the fallback would reach it")
    absent = tmp_path / "absent.toml"
    out = cli("status", env={"EDGED_CONFIG": str(absent)})
    assert out.returncode == 1
    assert f"cannot reach the daemon at {DEFAULT_SOCKET} (the default, as {absent} does not exist;" in out.stderr
    assert "--socket, $EDGED_SOCKET or [server] socket" in out.stderr


def test_a_socket_nobody_listens_on_is_refused_not_missing(tmp_path: Path) -> None:
    import socket

    stale = str(tmp_path / "stale.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(stale)  # what a killed daemon leaves behind
    s.close()
    out = cli("status", "--socket", stale)
    assert out.returncode == 1 and "connection refused" in out.stderr and stale in out.stderr
    out = cli("status", "--socket", str(tmp_path))
    assert out.returncode == 1 and "not a socket" in out.stderr


def test_infer_names_a_missing_or_unreadable_input_file(tiny_daemon: DaemonProcess, tmp_path: Path) -> None:
    sock = str(tiny_daemon.socket)
    out = cli("infer", "tiny", "--input", "x=missing.npy", "--socket", sock)
    assert out.returncode == 2
    assert "input 'x': no such file missing.npy" in out.stderr and "cannot reach" not in out.stderr
    (tmp_path / "text.npy").write_text("not numbers")
    out = cli("infer", "tiny", "--input", f"x={tmp_path / 'text.npy'}", "--socket", sock)
    assert out.returncode == 2 and "is not a .npy file" in out.stderr


# --- edged top ------------------------------------------------------------------------------------


class Traffic:
    """Requests to tiny from a thread until stopped, so request rates are above zero."""

    def __init__(self, d: DaemonProcess) -> None:
        self._d, self._stop = d, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.errors: list[str] = []

    def _run(self) -> None:
        x = np.ones((1, 16), np.float32)
        with self._d.client() as c:
            while not self._stop.is_set():
                try:
                    c.infer("tiny", {"x": x})
                except Exception as e:  # every failure is a finding
                    self.errors.append(repr(e))
                    return

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def row(lines: list[str], model: str) -> list[str]:
    for line in lines:
        if line.split() and line.split()[0] == model:
            return line.split()
    raise AssertionError(f"no row for {model} in {lines}")


def test_top_once_prints_one_plain_frame_with_rates(tiny_daemon: DaemonProcess) -> None:
    with Traffic(tiny_daemon) as traffic:
        out = cli("top", "--once", "--interval", "0.5", "--socket", str(tiny_daemon.socket), env={"COLUMNS": "80"})
    assert not traffic.errors, traffic.errors
    assert out.returncode == 0, out.stderr
    assert "\x1b" not in out.stdout
    lines = out.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), lines
    assert lines[0].startswith("edged ") and " ready " in lines[0]
    assert lines[1].startswith("memory (meminfo): used ")
    tiny = row(lines, "tiny")
    assert tiny[1:3] == ["ready", "fp32"] and tiny[-1] == "onnxruntime"
    assert float(tiny[6]) > 0, tiny  # req/s while the traffic ran
    assert float(tiny[4]) > 0 and float(tiny[5]) >= float(tiny[4])  # p50, p99
    assert row(lines, "spare")[1] == "lazy"


class Pty:
    """A program on a pseudo-terminal of a given size; its output collected by a thread."""

    def __init__(self, argv: list[str], cols: int = 80, rows: int = 24) -> None:
        self.master, slave = os.openpty()
        self.resize(cols, rows, slave)
        env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")} | {"TERM": "xterm"}
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True)
        os.close(slave)
        self._out = bytearray()
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def resize(self, cols: int, rows: int, fd: int | None = None) -> None:
        fcntl.ioctl(self.master if fd is None else fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO once the child has gone
                return
            if not chunk:
                return
            with self._lock:
                self._out += chunk

    def text(self) -> str:
        with self._lock:
            return self._out.decode(errors="replace")

    def frames(self) -> list[list[str]]:
        """Every complete frame drawn so far, as lines without escapes."""
        done = []
        for part in self.text().split("\x1b[H")[1:]:
            if "\x1b[J" in part:
                body = part.split("\x1b[J")[0]
                done.append([ANSI.sub("", line) for line in body.split("\r\n") if line])
        return done

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        os.close(self.master)


@pytest.fixture
def top_pty(tiny_daemon: DaemonProcess) -> Iterator[Pty]:
    p = Pty([sys.executable, "-m", "edged", "top", "--interval", "0.2", "--socket", str(tiny_daemon.socket)])
    yield p
    p.close()


def test_top_on_a_terminal_redraws_fits_the_width_and_quits_on_q(tiny_daemon: DaemonProcess, top_pty: Pty) -> None:
    first = wait_for(lambda: top_pty.frames(), 30, what="a first frame")[0]
    assert top_pty.text().startswith(ENTER)
    assert row(first, "tiny")[1] == "ready"
    with Traffic(tiny_daemon) as traffic:

        def busy_frame() -> list[str] | None:
            for frame in reversed(top_pty.frames()):
                cells = row(frame, "tiny")
                if cells[6] != "-" and float(cells[6]) > 0:
                    return frame
            return None

        frame = wait_for(busy_frame, 30, what="a frame with tiny's request rate above zero")
    assert not traffic.errors, traffic.errors
    assert float(row(frame, "tiny")[4]) > 0  # p50 once requests ran
    assert all(len(line) < 80 for f in top_pty.frames() for line in f)  # the last column stays free
    assert all(len(f) <= 23 for f in top_pty.frames())  # one line fewer than the terminal: no scrolling

    # A narrower terminal (SIGWINCH is not needed: each frame reads the size afresh).
    top_pty.resize(60, 20)
    os.killpg(top_pty.proc.pid, signal.SIGWINCH)  # as a terminal emulator sends it: no harm done
    seen = len(top_pty.frames())
    narrow = wait_for(lambda: len(top_pty.frames()) > seen + 1 and top_pty.frames()[-1], 30, what="a new frame")
    assert all(len(line) < 60 for line in narrow), narrow

    os.write(top_pty.master, b"q")
    wait_for(lambda: top_pty.proc.poll() is not None, 30, what="edged top to exit on q")
    assert top_pty.proc.returncode == 0
    wait_for(lambda: top_pty.text().endswith(LEAVE), 10, what="the terminal restored")


def test_top_rides_out_a_daemon_restart(tiny_daemon: DaemonProcess, top_pty: Pty) -> None:
    """The daemon stops under a running ``edged top``: it says so and keeps trying, then shows the
    new daemon once it is back."""

    def last_frame() -> list[str]:
        frames = top_pty.frames()
        return frames[-1] if frames else []

    wait_for(lambda: any(line.startswith("tiny ") for line in last_frame()), 30, what="a frame with tiny")
    assert tiny_daemon.stop() == 0

    def no_status() -> str | None:
        frame = last_frame()
        return frame[0] if frame and frame[0].startswith("edged: no status") else None

    assert "retrying" in wait_for(no_status, 30, what="a frame saying there is no status")
    assert top_pty.proc.poll() is None
    tiny_daemon.start()

    def back() -> bool:
        frame = last_frame()  # the new daemon answers while it warms up, then says ready
        return bool(frame) and frame[0].startswith("edged ") and row(frame, "tiny")[1] == "ready"

    wait_for(back, 60, what="tiny ready on the restarted daemon")
    os.write(top_pty.master, b"q")
    wait_for(lambda: top_pty.proc.poll() is not None, 30, what="edged top to exit on q")
    assert top_pty.proc.returncode == 0
