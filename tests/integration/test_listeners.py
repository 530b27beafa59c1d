"""TCP, metrics-only and socket-activated listeners, against a real daemon."""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest

from edged.client import Client
from tests.helpers import DaemonProcess, wait_for, write_config

pytestmark = pytest.mark.integration

BODY = orjson.dumps({"inputs": [{"name": "x", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}]})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tcp(port: int, method: str, path: str, body: bytes | None = None, token: str = "") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    conn.request(method, path, body=body, headers=headers)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data


def code(data: bytes) -> str:
    return str(orjson.loads(data)["code"])


@pytest.fixture
def tiny(daemon_factory: Callable[..., DaemonProcess], model_dir: Path) -> Callable[..., DaemonProcess]:
    def make(**server: object) -> DaemonProcess:
        return daemon_factory({"tiny": {"path": str(model_dir / "tiny.onnx")}}, extra={"server": server})

    return make


def test_tcp_and_metrics_listeners_on_loopback(tiny: Callable[..., DaemonProcess]) -> None:
    api, metrics = free_port(), free_port()
    d = tiny(tcp=[f"127.0.0.1:{api}"], metrics=f"127.0.0.1:{metrics}").start()
    assert tcp(api, "GET", "/v2/health/ready")[0] == 200
    status, data = tcp(api, "POST", "/v2/models/tiny/infer", BODY)
    assert status == 200 and orjson.loads(data)["outputs"][0]["shape"] == [1, 4]
    register = orjson.dumps({"key": "/whatever", "byte_size": 64})
    status, data = tcp(api, "POST", "/v2/systemsharedmemory/region/r/register", register)
    assert status == 400 and b"only available to local clients" in data  # a TCP peer has no uid
    status, data = tcp(metrics, "GET", "/metrics")
    assert status == 200 and b"edged_requests_total" in data
    assert tcp(metrics, "GET", "/v2/health/live")[0] == 200
    status, data = tcp(metrics, "POST", "/v2/models/tiny/infer", BODY)
    assert status == 404 and b"only /metrics" in data
    with d.client() as c:
        assert c.ready()  # the Unix socket still serves the API
    assert f"tcp 127.0.0.1:{api} (the API)" in d.log()


def test_a_non_loopback_listener_needs_a_token(tiny: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    port = free_port()
    d = tiny(tcp=[f"0.0.0.0:{port}"])
    d.start(wait_ready=False)
    assert d.proc is not None and d.proc.wait(60) != 0
    assert "is not a loopback address; set server.tcp_token_file" in d.log()

    token = "s3cret-token-0123456789"
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    port = free_port()
    d = tiny(tcp=[f"0.0.0.0:{port}"], tcp_token_file=str(token_file))
    d.start()
    status, data = tcp(port, "GET", "/v2/health/live")
    assert (status, code(data)) == (401, "unauthorized")
    assert code(tcp(port, "GET", "/v2/health/live", token="wrong-token-0123456789")[1]) == "unauthorized"
    assert tcp(port, "POST", "/v2/models/tiny/infer", BODY, token=token)[0] == 200
    assert "bearer token required" in d.log()


@pytest.fixture
def activated(tmp_path: Path, model_dir: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path, int, Path]]:
    """edged started the way systemd starts it with two sockets: LISTEN_FDS=2, fds 3 and 4, named."""
    unix_path = tmp_path / "activated.sock"
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(str(unix_path))
    unix.listen(16)
    metrics = socket.create_server(("127.0.0.1", 0))
    port = metrics.getsockname()[1]
    cfg = write_config(
        tmp_path / "act.toml",
        {
            "server": {"socket": str(tmp_path / "unused.sock")},
            "cache": {"dir": str(tmp_path / "cache")},
            "models.tiny": {"path": str(model_dir / "tiny.onnx")},
        },
    )
    log = tmp_path / "act.log"

    def place_fds() -> None:
        os.dup2(unix.fileno(), 3)
        os.dup2(metrics.fileno(), 4)

    env = dict(os.environ, LISTEN_FDS="2", LISTEN_FDNAMES="http:metrics", PYTHONUNBUFFERED="1")
    cmd = f'LISTEN_PID=$$; exec "{sys.executable}" -m edged serve --config "{cfg}"'
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["sh", "-c", f"export {cmd}"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=place_fds,
            pass_fds=(3, 4),  # kept through close_fds, which runs after preexec_fn
        )
    unix.close()
    metrics.close()
    try:
        yield proc, unix_path, port, log
    finally:
        proc.terminate()
        proc.wait(30)


def test_every_activated_socket_is_served(activated: tuple[subprocess.Popen[bytes], Path, int, Path]) -> None:
    proc, unix_path, port, log = activated

    def ready() -> bool:
        assert proc.poll() is None, log.read_text()
        with Client(str(unix_path), timeout=2) as c:
            return c.ready()

    wait_for(ready, 60, what="edged ready on the activated Unix socket")
    with Client(str(unix_path)) as c:
        assert c.infer("tiny", {"x": np.zeros((1, 16), np.float32)})["probs"].shape == (1, 4)
    status, data = tcp(port, "GET", "/metrics")
    assert status == 200 and b"edged_requests_total" in data  # the second socket is served too
    assert tcp(port, "POST", "/v2/models/tiny/infer", BODY)[0] == 404  # as metrics only, by its name
    text = log.read_text()
    assert "activated socket 'http' (fd 3, the API)" in text and "activated socket 'metrics' (fd 4" in text
