"""edged as a server under test: a daemon with its own configuration file, ready when its
sd_notify READY=1 arrives (what systemd waits for), its frames through a sealed memfd region it
maps (or a POSIX object it copies, or the request's body), and its status read through edged's own
client.
"""

from __future__ import annotations

import contextlib
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
from bench.servers import Server, copier, status_of
from bench.wire import Conn, decode_v2, v2_request, v2_request_in_place
from edged.client import Client
from edged.client.shm import MemfdRegion, ShmRegion
from edged.paths import fd_socket_for


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
        return status_of(self.addr, "/v2/health/ready") == 200

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


def get_status(addr: str) -> dict[str, Any]:
    with Client(addr) as c:
        return c.status()
