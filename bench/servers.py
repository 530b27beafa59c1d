"""The servers under test as child processes: start with an isolated HOME and TMPDIR, wait for
readiness, measure the whole process tree, stop by PID.

Each server knows how to encode a request for a model and how to set up a connection for a frame:
edged through a sealed memfd region per connection (handed over once; the daemon maps it), PyTriton
through a POSIX shared memory region per connection (registered once), the frame copied in before
each request in both; the hand-written FastAPI server with the frame's raw bytes.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.models import ModelSpec
from bench.wire import (
    Address,
    Conn,
    connect,
    decode_raw,
    decode_v2,
    http_bytes,
    raw_request,
    roundtrip,
    v2_request,
    v2_request_in_place,
)
from edged.client import Client
from edged.client.shm import MemfdRegion, ShmRegion, ShmTensor
from edged.paths import fd_socket_for

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


def _get(addr: Address, path: str) -> int:
    with connect(addr, timeout=2) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
        return int(s.recv(4096).split(b" ", 2)[1])


class EdgedServer(Server):
    """edged itself; readiness is its sd_notify READY=1 (what systemd waits for)."""

    name = "edged"
    # How the clients of every edged lane write a request in the body (bench.wire.FORMS): one
    # choice per run (overhead's --form), so that a daemon and its base read the same bytes.
    request_form = "binary"

    def __init__(
        self,
        work: Path,
        specs: dict[str, ModelSpec],
        options: dict[str, dict[str, Any]] | None = None,
        label: str = "edged",
        server: dict[str, Any] | None = None,
        shm: str = "memfd",
    ) -> None:
        self.name = label
        self.server_options = server or {}  # extra keys of the [server] table
        # How frames reach the daemon: "memfd" (a sealed memfd it maps, as edged's client does
        # where it can) or "posix" (a /dev/shm object it copies with preadv, as Triton's clients).
        self.shm = shm
        super().__init__(work, specs)
        self.options = options or {}  # per model: extra keys of its [models.NAME] table
        self.cache = self.dir / "cache"
        self.regions: list[ShmRegion | MemfdRegion] = []
        self.notify: socket.socket | None = None

    @property
    def addr(self) -> str:
        return str(self.dir / "edged.sock")

    def config(self) -> Path:
        from tests.helpers import write_config

        tables: dict[str, dict[str, Any]] = {
            "server": {"socket": self.addr, **self.server_options},
            "cache": {"dir": str(self.cache)},
            "lifecycle": {"watch_files": False},
        }
        for spec in self.specs.values():
            tables[f"models.{spec.name}"] = {
                "path": spec.path,
                "backend": "onnxruntime",
                "threads": spec.threads,
                **self.options.get(spec.name, {}),
            }
            if Path(spec.path).stem == "ocr_det":  # dynamic height and width: bound them
                tables[f"models.{spec.name}.profiles.x"] = {
                    "min": [1, 3, 32, 32],
                    "opt": [1, 3, 640, 640],
                    "max": [1, 3, 1280, 1280],
                }
        return write_config(self.dir / "edged.toml", tables)

    def command(self) -> list[str]:
        return [self.python, "-m", "edged", "serve", "--config", str(self.config())]

    def start(self) -> None:
        path = self.dir / "notify.sock"
        path.unlink(missing_ok=True)
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(path))
        super().start()

    def extra_env(self) -> dict[str, str]:
        return {"NOTIFY_SOCKET": str(self.dir / "notify.sock")}

    def wait_ready(self, timeout: float = 120.0, interval: float = 0.01) -> float:
        assert self.notify is not None and self.proc is not None
        deadline = time.monotonic() + timeout
        self.notify.settimeout(0.2)
        try:
            while time.monotonic() < deadline:
                try:
                    msg = self.notify.recv(4096)
                except TimeoutError:
                    if self.proc.poll() is not None:
                        raise RuntimeError(f"edged exited: {self.log_tail()}") from None
                    continue
                if b"READY=1" in msg.split(b"\n"):
                    ready = time.perf_counter() - self.spawned
                    self._drain_notify()
                    return ready
        except BaseException:
            self._close_notify()
            raise
        raise RuntimeError(
            f"edged not ready after {timeout} s; stacks:\n{self.dump_stacks()}\nlog tail:\n{self.log_tail()}"
        )

    def dump_stacks(self) -> str:
        """What every thread of the daemon is doing (py-spy), kept next to its log."""
        spy = Path(sys.executable).parent / "py-spy"
        if self.proc is None or not spy.exists():
            return "(py-spy not available)"
        run = subprocess.run(
            [str(spy), "dump", "--pid", str(self.proc.pid), "--locals"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        text = run.stdout + run.stderr
        (self.dir / "stacks.txt").write_text(text)
        return text

    def _drain_notify(self) -> None:
        """Keep reading the notify socket after READY=1: the daemon's STATUS= lines (a background
        build sends several) would otherwise fill its queue (10 datagrams), and the daemon's next
        sd_notify would block in sendto, as it never would under systemd."""
        sock = self.notify
        assert sock is not None
        sock.settimeout(None)

        def drain() -> None:
            with contextlib.suppress(OSError):
                while sock.recv(4096):
                    pass

        threading.Thread(target=drain, name="notify-drain", daemon=True).start()

    def _close_notify(self) -> None:
        if self.notify is not None:
            with contextlib.suppress(OSError):
                self.notify.shutdown(socket.SHUT_RDWR)  # wakes the drain thread's recv
            self.notify.close()
            self.notify = None

    def stop(self, timeout: float = 30.0) -> None:
        super().stop(timeout)  # the notify socket stays bound until then: STOPPING=1 lands
        self._close_notify()

    def is_ready(self) -> bool:
        return _get(self.addr, "/v2/health/ready") == 200

    def wait_built(self, timeout: float = 600.0) -> None:
        """Until no build is queued or running: the engine cache is complete, so the next start
        is a pure cache hit with no background build under the measurement."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = get_status(self.addr)
            line = str(st.get("status", ""))
            if not st.get("builds") and "building" not in line and "queued" not in line:
                return
            time.sleep(0.2)  # polling the daemon's status, bounded by the deadline
        raise RuntimeError(f"edged still building after {timeout} s: {self.log_tail()}")

    def request(self, spec: ModelSpec, x: np.ndarray) -> bytes:
        return v2_request(spec.name, spec.input, x, spec.outputs, self.request_form)

    def decode(self, spec: ModelSpec, head: bytes, body: bytes) -> np.ndarray:
        return decode_v2(head, body)[spec.outputs[0]]

    def in_place_conn(self, spec: ModelSpec, x: np.ndarray, out: np.ndarray) -> tuple[Conn, Callable[[], np.ndarray]]:
        """A connection whose frame is already in a sealed memfd region and whose answer edged
        writes into the same region, after the frame (no tensor in either body); and a reader of
        that answer, a view of the region."""
        region = MemfdRegion(f"{self.name}.{spec.name}-{len(self.regions)}", x.nbytes + out.nbytes)
        region.register(fd_socket_for(self.addr), 30.0)
        self.regions.append(region)
        tensor = region.put(x)
        request = v2_request_in_place(spec.name, spec.input, tensor, spec.outputs[0], x.nbytes, out.nbytes)

        def answer() -> np.ndarray:
            return region.read(out.dtype, out.shape, x.nbytes)

        return Conn(self.addr, request), answer

    def frame_conn(self, spec: ModelSpec, x: np.ndarray, index: int) -> Conn:
        if self.shm == "body":  # the frame in the request's body, as a client without shared memory sends it
            return Conn(self.addr, self.request(spec, x))
        name = f"{self.name}.{spec.name}-{len(self.regions)}"
        region: ShmRegion | MemfdRegion
        if self.shm == "memfd":
            region = MemfdRegion(name, x.nbytes)
            region.register(fd_socket_for(self.addr), 30.0)
        else:
            region = ShmRegion(name, x.nbytes)
            with Client(self.addr) as c:
                c.register_shm(region.name, region.key, x.nbytes)
        self.regions.append(region)
        tensor = region.put(x)
        return Conn(
            self.addr,
            v2_request(spec.name, spec.input, tensor, spec.outputs),
            before=copier(region, np.ascontiguousarray(x)),
        )

    def close_frames(self) -> None:
        with contextlib.suppress(OSError), Client(self.addr) as c:
            c.unregister_shm()
        for r in self.regions:
            r.close()
        self.regions.clear()


def copier(region: ShmRegion | MemfdRegion, x: np.ndarray) -> Callable[[], None]:
    """The producer writing its frame ``x`` (contiguous) into the region, before each request."""
    src = x.reshape(-1).view(np.uint8)
    n = src.nbytes

    def copy() -> None:  # the producer writing its frame into the region (no view outlives it)
        np.copyto(region.array_view[:n], src)

    return copy


class FastAPIServer(Server):
    """What users write by hand: FastAPI on uvicorn (httptools, uvloop), lazy model loading."""

    name = "fastapi"

    @property
    def addr(self) -> str:
        return str(self.dir / "fastapi.sock")

    def command(self) -> list[str]:
        return [
            self.python,
            "-m",
            "uvicorn",
            "bench.peer_fastapi:app",
            "--uds",
            self.addr,
            "--loop",
            "uvloop",
            "--http",
            "httptools",
            "--no-access-log",
            "--log-level",
            "warning",
        ]

    def extra_env(self) -> dict[str, str]:
        return {"BENCH_SPECS": str(self.dir.parent / "specs.json")}

    def start(self) -> None:
        Path(self.addr).unlink(missing_ok=True)
        super().start()

    def is_ready(self) -> bool:
        return _get(self.addr, "/health") == 200

    def request(self, spec: ModelSpec, x: np.ndarray) -> bytes:
        return raw_request(spec.name, x)

    def decode(self, spec: ModelSpec, head: bytes, body: bytes) -> np.ndarray:
        return decode_raw(head, body)


class PyTritonServer(Server):
    """PyTriton (Triton's server binary, the callables in a Python process) under bench/.venv."""

    name = "pytriton"
    python = str(REPO / "bench" / ".venv" / "bin" / "python")
    stop_signal = signal.SIGINT  # what PyTriton's serve() says to send

    def __init__(self, work: Path, specs: dict[str, ModelSpec], port: int = 18500) -> None:
        super().__init__(work, specs)
        self.port = port
        self.token = secrets.token_urlsafe(16)
        self.handles: list[Any] = []

    @property
    def addr(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    def command(self) -> list[str]:
        return [
            self.python,
            "-m",
            "bench.peer_pytriton",
            str(self.dir.parent / "specs.json"),
            str(self.port),
            str(self.port + 1),
        ]

    def extra_env(self) -> dict[str, str]:
        # Triton's Python backend stub links libpython: it must be the one of the venv's base
        # interpreter, not a system copy of another patch release.
        base = Path(os.path.realpath(self.python)).parent.parent / "lib"
        return {"LD_LIBRARY_PATH": f"{base}:{os.environ.get('LD_LIBRARY_PATH', '')}", "BENCH_TRITON_TOKEN": self.token}

    def is_ready(self) -> bool:
        return all(_get(self.addr, f"/v2/models/{m}/ready") == 200 for m in self.specs)

    def request(self, spec: ModelSpec, x: np.ndarray) -> bytes:
        return v2_request(spec.name, spec.input, x, spec.outputs)

    def decode(self, spec: ModelSpec, head: bytes, body: bytes) -> np.ndarray:
        return decode_v2(head, body)[spec.outputs[0]]

    @classmethod
    def available(cls) -> bool:
        if not Path(cls.python).exists():
            return False
        probe = subprocess.run([cls.python, "-c", "import pytriton"], capture_output=True, check=False)
        return probe.returncode == 0

    def clean_shm(self, pid: int) -> list[str]:
        left = sorted(p.name for p in Path("/dev/shm").glob(f"pytrtion{pid}-*"))
        for name in left:
            (Path("/dev/shm") / name).unlink(missing_ok=True)
        return left

    @property
    def _auth(self) -> dict[str, str]:
        return {"triton-access-token": self.token}

    def frame_conn(self, spec: ModelSpec, x: np.ndarray, index: int) -> Conn:
        import tritonclient.http as httpclient
        import tritonclient.utils.shared_memory as shm

        index = len(self.handles)
        name, key = f"{spec.name}-{index}", f"/bench-{os.getpid()}-{spec.name}-{index}"
        handle = shm.create_shared_memory_region(name, key, x.nbytes)
        self.handles.append(handle)
        client = httpclient.InferenceServerClient(f"127.0.0.1:{self.port}")
        client.register_system_shared_memory(name, key, x.nbytes, headers=self._auth)
        client.close()
        frame = np.ascontiguousarray(x)
        tensor = ShmTensor(name, frame.dtype, frame.shape, frame.nbytes)

        def copy() -> None:  # tritonclient's own utility: the producer writing its frame
            shm.set_shared_memory_region(handle, [frame])

        return Conn(self.addr, v2_request(spec.name, spec.input, tensor, spec.outputs), before=copy)

    def close_frames(self) -> None:
        import tritonclient.http as httpclient
        import tritonclient.utils.shared_memory as shm

        with contextlib.suppress(Exception):
            client = httpclient.InferenceServerClient(f"127.0.0.1:{self.port}")
            client.unregister_system_shared_memory(headers=self._auth)
            client.close()
        for h in self.handles:
            shm.destroy_shared_memory_region(h)
        self.handles.clear()


def check(server: Server, spec: ModelSpec, x: np.ndarray, want: np.ndarray) -> None:
    """The server's answer matches ONNX Runtime in-process (before any timing)."""
    with connect(server.addr) as s:
        head, body = roundtrip(s, server.request(spec, x))
    got = server.decode(spec, head, body)
    if got.shape != want.shape or not np.allclose(got, want, rtol=1e-4, atol=1e-5):
        raise AssertionError(f"{server.name}/{spec.name}: wrong answer (max diff {np.abs(got - want).max()})")


def get_status(addr: str) -> dict[str, Any]:
    with Client(addr) as c:
        return c.status()


__all__ = [
    "EdgedServer",
    "FastAPIServer",
    "PyTritonServer",
    "Server",
    "check",
    "copier",
    "get_status",
    "http_bytes",
    "placement",
    "tree",
    "tree_memory",
]
