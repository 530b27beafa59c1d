"""Shared test helpers: a real edged daemon as a subprocess, waiting on conditions, a health
prober of its own process, and skipping for what a machine lacks (a failure under CI).

Nothing here fakes the daemon: it is started as ``python -m edged serve`` on a temporary socket
and cache, exactly as a user starts it, and stopped by PID.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import pytest

from edged.client import Client

REPO = Path(__file__).resolve().parent.parent

# A loop that answers nothing for this long is frozen. The bound of every "does not hang or
# freeze" check: how fast an answer comes is for the benchmarks (bench/), not for a timed test.
FREEZE_S = 1.0


def under_ci() -> bool:
    """Whether this is CI (it sets CI=true): there scripts/test.sh has installed every tool and
    package the tests use, and runs them as root on Debian with systemd."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def unavailable(reason: str) -> NoReturn:
    """Skip a test for something this machine lacks, printing why. Under CI, which provides
    everything but TensorRT, a Jetson and an NVIDIA GPU, the same absence fails the test instead:
    a broken set-up must not pass green as a row of skips."""
    if under_ci():
        pytest.fail(f"{reason} (CI must provide it: scripts/test.sh)", pytrace=False)
    print(f"SKIP: {reason}")
    pytest.skip(reason)


def tensorrt_installed() -> bool:
    """Whether the tensorrt module itself is installed, not only the tensorrt-stubs' .pyi files
    (a namespace package): found without importing it, and without asking edged."""
    spec = importlib.util.find_spec("tensorrt")
    return spec is not None and spec.origin is not None


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
    def __init__(
        self, config: Path, socket: Path, log: Path, env: dict[str, str] | None = None, python: str | None = None
    ) -> None:
        """``python``: the interpreter that runs it (another environment's), this one's by default."""
        self.config, self.socket, self.log_path = config, socket, log
        self.python = python or sys.executable
        self.env = dict(os.environ, **(env or {}))
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, wait_ready: bool = True, timeout: float = 60.0) -> DaemonProcess:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [self.python, "-m", "edged", "serve", "--config", str(self.config)],
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


def closed_by_peer(s: socket.socket) -> bool:
    """Whether the other end has closed ``s``, a connection on which the daemon never speaks
    first (a peer that sends nothing): a read sees the end, or a reset, within 50 ms."""
    s.settimeout(0.05)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def sample(d: DaemonProcess, series: str) -> float:
    """The value of the one metric sample whose line starts with ``series`` (name and labels,
    as the exposition writes them): an error if the daemon does not expose it."""
    with d.client(timeout=10) as c:
        _, body, _ = c.request("GET", "/metrics")
    (line,) = [x for x in body.decode().splitlines() if x.startswith(series + " ")]
    return float(line.rsplit(" ", 1)[1])


def loop_stalls(d: DaemonProcess) -> float:
    """How many event-loop stalls over lifecycle.loop_stall_ms the daemon has counted."""
    return sample(d, "edged_loop_stalls_total")


def while_held(d: DaemonProcess, wedge: Path, model: str, count: int, send: Callable[[], list[Any]]) -> list[Any]:
    """What ``send`` (``count`` requests to ``model`` at once) returns, sent while the model's
    worker hangs on the first it took (the test-only wedge at ``wedge``, edged/lifecycle/faults.py,
    set in the daemon's environment) and released once the model holds them all, queued or
    running: the rest queue behind the held one, so they batch whatever the machine's speed."""
    wedge.touch()
    results: list[Any] = []
    sender = threading.Thread(target=lambda: results.extend(send()))
    sender.start()
    try:
        with d.client() as c:
            wait_for(lambda: c.status()["models"][model]["queue"] == count, 30, what=f"{count} requests held")
    finally:
        wedge.unlink(missing_ok=True)
        sender.join(60)
    assert len(results) == count, results
    return results


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


_PROBER = """
import select, sys, time
from edged.client import Client
worst, count = 0.0, 0
with Client(sys.argv[1], timeout=60) as c:
    for _ in range(3):  # the connection's set-up is not what is measured
        assert c.live()
    print("ready", flush=True)
    while not select.select([sys.stdin], [], [], 0)[0]:  # until the test closes our stdin
        t0 = time.perf_counter()
        assert c.live()
        worst = max(worst, time.perf_counter() - t0)
        count += 1
print(count, worst, flush=True)
"""


class HealthProber:
    """Asks /v2/health/live back to back over its own connection, from its own process (so the
    test's own work cannot delay it), and keeps the slowest answer: the longest the daemon's
    event loop left a request waiting while the prober ran."""

    def __init__(self, sock: Path) -> None:
        self.sock = sock
        self.worst = 0.0
        self.count = 0

    @contextlib.contextmanager
    def running(self) -> Iterator[HealthProber]:
        """Probing from its first answer (when the block starts) until the block ends."""
        proc = subprocess.Popen(
            [sys.executable, "-c", _PROBER, str(self.sock)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        assert proc.stdin is not None and proc.stdout is not None
        try:
            assert proc.stdout.readline() == "ready\n", "the health prober did not start"
            yield self
            proc.stdin.close()
            line = proc.stdout.readline()
            assert line, "the health prober failed: a health check timed out (60 s) while it ran"
            count, worst = line.split()
            self.count, self.worst = int(count), float(worst)
            assert proc.wait(30) == 0
        finally:
            proc.kill()
            proc.wait(30)
        assert self.count > 0, "no health check ran while the prober ran"


def grpc_call_headers(method: str) -> list[tuple[str, str]]:
    """The HTTP/2 request headers of a call to GRPCInferenceService's ``method``, for a raw h2
    client."""
    return [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", f"/inference.GRPCInferenceService/{method}"),
        (":authority", "localhost"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]
