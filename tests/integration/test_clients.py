"""The asyncio client and the command line against a real daemon."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from edged import errors
from edged.client import AsyncClient
from tests.helpers import DaemonProcess

pytestmark = pytest.mark.integration


@pytest.fixture
def tiny_daemon(daemon_factory: Callable[..., DaemonProcess], model_dir: Path) -> DaemonProcess:
    return daemon_factory({"tiny": {"path": str(model_dir / "tiny.onnx")}}).start()


def test_async_client_concurrent_requests(tiny_daemon: DaemonProcess) -> None:
    async def main() -> list[np.ndarray]:
        clients = [AsyncClient(str(tiny_daemon.socket)) for _ in range(4)]
        try:
            assert await clients[0].ready()
            xs = [np.full((1, 16), i, np.float32) for i in range(4)]
            outs = await asyncio.gather(*(c.infer("tiny", {"x": x}) for c, x in zip(clients, xs)))
            with pytest.raises(errors.ModelNotFoundError):
                await clients[0].infer("nope", {"x": xs[0]})
            # The connection survives an error response.
            again = await clients[0].infer("tiny", {"x": xs[0]})
            assert np.array_equal(again["probs"], outs[0]["probs"])
            return [o["probs"] for o in outs]
        finally:
            for c in clients:
                await c.close()

    outs = asyncio.run(main())
    assert all(o.shape == (1, 4) for o in outs)
    assert not np.allclose(outs[0], outs[3])  # different inputs, different answers


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edged", *args],
        capture_output=True,
        text=True,
        env=dict(os.environ, **(env or {})),
        timeout=60,
    )


def test_command_line(tiny_daemon: DaemonProcess, tmp_path: Path) -> None:
    sock = str(tiny_daemon.socket)
    assert cli("health", "--ready", "--socket", sock).returncode == 0
    assert cli("health", "--socket", str(tmp_path / "nothing.sock")).returncode == 1
    models = cli("models", env={"EDGED_SOCKET": sock})  # the socket from the environment
    assert models.returncode == 0 and "tiny" in models.stdout and "ready" in models.stdout
    np.save(tmp_path / "x.npy", np.ones((2, 16), np.float32))
    out = cli(
        "infer", "tiny", "--input", f"x={tmp_path / 'x.npy'}", "--output", str(tmp_path / "o.npz"), "--socket", sock
    )
    assert out.returncode == 0, out.stderr
    with np.load(tmp_path / "o.npz") as saved:
        assert saved["probs"].shape == (2, 4)
    shm = cli("infer", "tiny", "--input", f"x={tmp_path / 'x.npy'}", "--shm", "--socket", sock)
    assert shm.returncode == 0 and "probs: float32[2, 4]" in shm.stdout
    bad = cli("infer", "tiny", "--input", f"y={tmp_path / 'x.npy'}", "--socket", sock)
    assert bad.returncode == 2 and "takes inputs [x]" in bad.stderr
    st = json.loads(cli("status", "--json", "--config", str(tiny_daemon.config)).stdout)
    assert st["models"]["tiny"]["state"] == "ready"  # the socket from the config


def test_config_error_exits_78_and_names_the_key(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[server]\nsockett = 'x'\n")
    out = cli("serve", "--config", str(cfg))
    assert out.returncode == 78
    assert "bad.toml: server.sockett: unknown key" in out.stderr


def test_stale_socket_from_a_crashed_run_is_replaced(
    daemon_factory: Callable[..., DaemonProcess], model_dir: Path
) -> None:
    import socket

    d = daemon_factory({"tiny": {"path": str(model_dir / "tiny.onnx")}})
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(d.socket))  # a socket file nobody listens on, as a killed daemon leaves it
    stale.close()
    assert d.socket.exists()
    d.start()
    assert "removing stale socket" in d.log()
    with d.client() as c:
        assert c.ready()
