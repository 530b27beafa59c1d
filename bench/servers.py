"""The servers under test as child processes: start with an isolated HOME and TMPDIR, wait for
readiness, measure the whole process tree, stop by PID; and the checks every server passes before
any timing.

Each server (a subclass of ``Server``: edged in bench/edged_server.py, its peers in
bench/peer_servers.py, the bare limit servers in bench/limit_servers.py) knows how to encode a
request for a model and how to set up a connection for a frame: edged through a sealed memfd region
per connection (handed over once; the daemon maps it), PyTriton through a POSIX shared memory region
per connection (registered once), the frame copied in before each request in both; the hand-written
FastAPI server with the frame's raw bytes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.models import ModelSpec
from bench.wire import Address, Conn, connect, http_bytes, roundtrip
from edged.client.shm import MemfdRegion, ShmRegion

REPO = Path(__file__).resolve().parent.parent


def tree(pid: int) -> list[int]:
    """pid and every descendant, from /proc/<pid>/task/<tid>/children."""
    out, stack = [], [pid]
    while stack:
        p = stack.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    stack += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def _kib(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_memory(pid: int) -> dict[str, Any]:
    """Resident memory of the whole tree: RSS summed (counts shared pages once per process) and
    PSS summed (shares them out: the tree's real cost)."""
    pids = tree(pid)
    rss = sum(_kib(f"/proc/{p}/status", "VmRSS:") for p in pids)
    pss = sum(_kib(f"/proc/{p}/smaps_rollup", "Pss:") for p in pids)
    return {"processes": len(pids), "rss_mib": rss / 1024, "pss_mib": pss / 1024}


def placement(pid: int) -> dict[str, list[int]]:
    out = {}
    for p in tree(pid):
        with contextlib.suppress(OSError):
            out[str(p)] = sorted(os.sched_getaffinity(p))
    return out


class Server:
    """One server process; subclasses say how to run it, when it is ready and how to talk to it."""

    name = "server"
    answers = True  # its answers are the model's, checked against ONNX Runtime's before timing
    python = sys.executable
    stop_signal = signal.SIGTERM

    def __init__(self, work: Path, specs: dict[str, ModelSpec]) -> None:
        self.cwd = REPO  # the server's working directory (``python -m`` puts it first on sys.path)
        self.dir = work / self.name
        self.specs = specs
        self.proc: subprocess.Popen[bytes] | None = None
        self.spawned = 0.0
        self.stopped_leftovers: list[int] = []
        self.leaked_shm: list[str] = []
        for sub in ("home", "tmp"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)

    # --- subclass hooks ---

    def command(self) -> list[str]:
        raise NotImplementedError

    def extra_env(self) -> dict[str, str]:
        return {}

    def is_ready(self) -> bool:
        raise NotImplementedError

    @property
    def addr(self) -> Address:
        raise NotImplementedError

    def request(self, spec: ModelSpec, x: np.ndarray) -> bytes:
        raise NotImplementedError

    def decode(self, spec: ModelSpec, head: bytes, body: bytes) -> np.ndarray:
        raise NotImplementedError

    def frame_conn(self, spec: ModelSpec, x: np.ndarray, index: int) -> Conn:
        """A connection for a frame-sized input (default: the bytes in the body)."""
        return Conn(self.addr, self.request(spec, x))

    def close_frames(self) -> None:
        """Release what frame connections registered (regions)."""

    # --- lifecycle ---

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("EDGED_", "NOTIFY_SOCKET", "PYTHON"))}
        env.update(
            HOME=str(self.dir / "home"),
            TMPDIR=str(self.dir / "tmp"),
            XDG_CACHE_HOME=str(self.dir / "home" / ".cache"),
            PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
            PYTHONUNBUFFERED="1",
        )
        env.update(self.extra_env())
        return env

    def start(self) -> None:
        with open(self.dir / "server.log", "ab") as log:
            self.spawned = time.perf_counter()
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env(),
                cwd=self.cwd,
                start_new_session=True,
            )

    def wait_ready(self, timeout: float = 120.0, interval: float = 0.01) -> float:
        """Seconds from spawn to ready."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.log_tail()}")
            with contextlib.suppress(OSError, RuntimeError):
                if self.is_ready():
                    return time.perf_counter() - self.spawned
            time.sleep(interval)  # polling the peer's readiness endpoint, bounded by the deadline
        raise RuntimeError(f"{self.name} not ready after {timeout} s: {self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        p = self.dir / "server.log"
        return p.read_text(errors="replace")[-n:] if p.exists() else ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def memory(self) -> dict[str, Any]:
        return tree_memory(self.pid)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the server's own PID; then SIGKILL whatever of its tree is left, by PID."""
        if self.proc is None:
            return
        pids = tree(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(self.stop_signal)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        deadline = time.monotonic() + timeout
        while any(_alive(p) for p in pids[1:]) and time.monotonic() < deadline:
            time.sleep(0.05)  # the children's own shutdown (Triton's server), bounded
        self.stopped_leftovers = [p for p in pids[1:] if _alive(p)]
        for p in self.stopped_leftovers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        self.leaked_shm = self.clean_shm(pids[0])
        self.proc = None

    def clean_shm(self, pid: int) -> list[str]:
        """Remove what the stopped server left in /dev/shm (its own objects); return their names."""
        return []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def status_of(addr: Address, path: str) -> int:
    """The HTTP status of ``GET path`` on a server (a readiness probe)."""
    with connect(addr, timeout=2) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
        return int(s.recv(4096).split(b" ", 2)[1])


def copier(region: ShmRegion | MemfdRegion, x: np.ndarray) -> Callable[[], None]:
    """The producer writing its frame ``x`` (contiguous) into the region, before each request."""
    src = x.reshape(-1).view(np.uint8)
    n = src.nbytes

    def copy() -> None:  # the producer writing its frame into the region (no view outlives it)
        np.copyto(region.array_view[:n], src)

    return copy


def check(server: Server, spec: ModelSpec, x: np.ndarray, want: np.ndarray) -> None:
    """The server's answer matches ONNX Runtime in-process (before any timing)."""
    with connect(server.addr) as s:
        head, body = roundtrip(s, server.request(spec, x))
    got = server.decode(spec, head, body)
    if got.shape != want.shape or not np.allclose(got, want, rtol=1e-4, atol=1e-5):
        raise AssertionError(f"{server.name}/{spec.name}: wrong answer (max diff {np.abs(got - want).max()})")


__all__ = [
    "Server",
    "check",
    "copier",
    "http_bytes",
    "placement",
    "status_of",
    "tree",
    "tree_memory",
]
