"""The peers edged is measured against, as child processes: the hand-written FastAPI server (the
frame's raw bytes in the body) and PyTriton (Triton's server binary under bench/.venv, frames
through POSIX shared memory registered with tritonclient's utilities). Their apps are
bench/peer_fastapi.py and bench/peer_pytriton.py.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
from pathlib import Path
from typing import Any

import numpy as np

from bench.models import ModelSpec
from bench.servers import REPO, Server, status_of
from bench.wire import Conn, decode_raw, decode_v2, raw_request, v2_request
from edged.client.shm import ShmTensor


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
        return status_of(self.addr, "/health") == 200

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
        return all(status_of(self.addr, f"/v2/models/{m}/ready") == 200 for m in self.specs)

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
