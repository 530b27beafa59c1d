"""Shared test helpers: a real edged daemon as a subprocess, and waiting on conditions.

Nothing here fakes the daemon: it is started as ``python -m edged serve`` on a temporary socket
and cache, exactly as a user starts it, and stopped by PID.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from edged.client import Client


def wait_for(cond: Callable[[], Any], timeout: float = 30.0, interval: float = 0.02, what: str = "condition") -> Any:
    """Poll ``cond`` until it returns a truthy value; fail the test with ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = cond()
            if value:
                return value
        except AssertionError:
            raise
        except Exception as e:  # the condition may raise until it holds (socket not there yet)
            last_exc = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last error: {last_exc!r})")


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_config(path: Path, tables: dict[str, dict[str, Any]]) -> Path:
    """Write a TOML file from {"server": {...}, "models.tiny": {...}, ...}."""
    lines = []
    for table, values in tables.items():
        lines.append(f"[{table}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in values.items()]
        lines.append("")
    path.write_text("\n".join(lines))
    return path


class DaemonProcess:
    def __init__(self, config: Path, socket: Path, log: Path, env: dict[str, str] | None = None) -> None:
        self.config, self.socket, self.log_path = config, socket, log
        self.env = dict(os.environ, **(env or {}))
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, wait_ready: bool = True, timeout: float = 60.0) -> DaemonProcess:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "edged", "serve", "--config", str(self.config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        if wait_ready:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        def ready() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"edged exited with {self.proc.returncode}:\n{self.log()}")
            with Client(str(self.socket), timeout=2) as c:
                return c.ready()

        try:
            wait_for(ready, timeout, what="edged ready")
        except AssertionError as e:
            raise AssertionError(f"{e}\n--- daemon log ---\n{self.log()}") from None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def client(self, timeout: float = 30.0) -> Client:
        return Client(str(self.socket), timeout=timeout)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@contextlib.contextmanager
def running(config: Path, socket: Path, log: Path, **kw: Any) -> Iterator[DaemonProcess]:
    d = DaemonProcess(config, socket, log, **kw).start()
    try:
        yield d
    finally:
        d.stop()
        d.kill()


class RequestStream:
    """Clients sending requests to model ``m`` back to back while a test swaps it underneath;
    every failure is recorded and, given ``expected``, every answer ("probs") is checked."""

    def __init__(self, d: DaemonProcess, expected: np.ndarray | None = None, clients: int = 3) -> None:
        self.d, self.expected = d, expected
        self.stop, self.ok = threading.Event(), 0
        self.failures: list[str] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run) for _ in range(clients)]

    def _run(self) -> None:
        x = np.ones((1, 16), np.float32)
        with self.d.client() as c:
            while not self.stop.is_set():
                try:
                    out = c.infer("m", {"x": x})["probs"]
                    if self.expected is not None:
                        np.testing.assert_allclose(out, self.expected, rtol=1e-4, atol=1e-6)
                    with self.lock:
                        self.ok += 1
                except Exception as e:
                    self.failures.append(repr(e))

    def __enter__(self) -> RequestStream:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)


def raw_http(
    sock: Path, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> tuple[int, bytes, http.client.HTTPResponse]:
    """A plain HTTP/1.1 request over the Unix socket, as curl --unix-socket would send it."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(str(sock))
    conn = http.client.HTTPConnection("localhost")
    conn.sock = s
    conn.request(method, path, body=body, headers=headers or {})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data, resp


class FakeClock:
    """Seconds that advance only when a fake model runs (pure-logic tests of timed decisions)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now
