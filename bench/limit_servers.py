"""The bare servers of the benchmarks' limit lanes (their apps are bench/limit.py): the echo, the
limit (the model run on the loop on an input it holds), limitv2 (edged's protocol code around the
run), limitworker (the run on a worker thread) and limitposix (limitworker with the frame through
a POSIX object, copied in and out as edged copies it). Each is uvicorn on a Unix socket with
uvloop and httptools, edged's own stack, so a lane's figure is what any server on it can do.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.models import ModelSpec
from bench.servers import Server, copier
from bench.wire import Conn, connect, decode_v2, http_bytes, roundtrip, v2_request
from edged.client.shm import ShmRegion


class EchoServer(Server):
    """A bare ASGI app on the same uvicorn stack as edged (uvloop, httptools, a Unix socket) that
    reads the request and answers a fixed 100-byte body (bench/limit.py): the transport's own cost."""

    name = "echo"
    answers = False
    app = "bench.limit:echo_app"

    @property
    def addr(self) -> str:
        return str(self.dir / f"{self.name}.sock")

    def command(self) -> list[str]:
        server = ["--uds", self.addr, "--loop", "uvloop", "--http", "httptools", "--no-access-log"]
        return [self.python, "-m", "uvicorn", self.app, *server, "--log-level", "warning"]

    def start(self) -> None:
        Path(self.addr).unlink(missing_ok=True)
        super().start()

    def is_ready(self) -> bool:
        with connect(self.addr, timeout=1.0) as sock:
            roundtrip(sock, http_bytes("/", b"", {}))
        return True

    def request(self, spec: ModelSpec, x: np.ndarray) -> bytes:
        return v2_request(spec.name, spec.input, x, spec.outputs)

    def decode(self, spec: ModelSpec, head: bytes, body: bytes) -> np.ndarray:
        """For a lane that answers the V2 request with the model's output (limitv2)."""
        return decode_v2(head, body)[spec.outputs[0]]


class LimitServer(EchoServer):
    """The echo's stack running the model on its loop on an input it holds (bench/limit.py):
    what any server on this stack can do, the limit a target is judged against."""

    name = "limit"
    app = "bench.limit:app"

    def extra_env(self) -> dict[str, str]:
        return {"BENCH_SPECS": str(self.dir.parent / "specs.json"), "BENCH_MODELS": ",".join(self.specs)}

    def request(self, spec: ModelSpec, x: np.ndarray) -> bytes:
        return http_bytes(f"/{spec.name}", b"", {})  # the server holds its input: only the request crosses

    def frame_conn(self, spec: ModelSpec, x: np.ndarray, index: int) -> Conn:
        return Conn(self.addr, self.request(spec, x))


class LimitV2Server(LimitServer):
    """The least an Open Inference Protocol server does on this stack (bench/limit.py: v2_app):
    edged's client's request, decoded, run on the loop and encoded by edged's protocol code."""

    name = "limitv2"
    app = "bench.limit:v2_app"
    answers = True
    request = EchoServer.request  # the V2 request, not the limit's bare GET


class LimitWorkerServer(LimitServer):
    """The limit with the model run on a worker thread (bench/limit.py): what a server that keeps
    its event loop free during a run can do, the bound for a model too slow to run on the loop."""

    name = "limitworker"
    app = "bench.limit:worker_app"


class LimitPosixServer(LimitWorkerServer):
    """limitworker with a frame through a POSIX object (bench/limit.py: posix_app): the client
    writes its frame into its object, the server's worker copies it out (preadv), runs the model
    and copies the answer in after the frame (pwrite), then the echo's answer: the least a server
    that keeps its loop free and may not map a client's object does, the bound of edged-posix."""

    name = "limitposix"
    app = "bench.limit:posix_app"

    def __init__(self, work: Path, specs: dict[str, ModelSpec]) -> None:
        super().__init__(work, specs)
        self.regions: list[ShmRegion] = []

    def frame_conn(self, spec: ModelSpec, x: np.ndarray, index: int) -> Conn:
        # Twice the frame: room for the answer after it (no model here answers more than its input).
        region = ShmRegion(f"{self.name}.{spec.name}-{len(self.regions)}", 2 * x.nbytes)
        self.regions.append(region)
        path = f"/{spec.name}/{region.key.lstrip('/')}"
        return Conn(self.addr, http_bytes(path, b"", {}), before=copier(region, np.ascontiguousarray(x)))

    def close_frames(self) -> None:
        for r in self.regions:
            r.close()
        self.regions.clear()
