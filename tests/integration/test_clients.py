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
from tests.helpers import DaemonProcess, wait_for

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


# --- regions of the Python client ----------------------------------------------------------------

KILLED = """
import os, signal, sys
import numpy as np
from edged.client import Client
c = Client(sys.argv[1])
out = c.infer_shm("tiny", {"x": np.ones((1, 16), np.float32)})
print(os.getpid(), out["probs"].shape, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no close(), no atexit
"""


def test_two_clients_in_one_process_have_their_own_regions(tiny_daemon: DaemonProcess) -> None:
    x = np.ones((1, 16), np.float32)
    with tiny_daemon.client() as a, tiny_daemon.client() as b:
        out_a = a.infer_shm("tiny", {"x": x})
        out_b = b.infer_shm("tiny", {"x": x * 2})
        names = sorted(r["name"] for r in a.shm_status())
        assert len(names) == 2 and all(n.startswith(f"tiny.x.{os.getpid()}.") for n in names)
        assert not np.allclose(out_a["probs"], out_b["probs"])
        assert np.array_equal(a.infer_shm("tiny", {"x": x})["probs"], out_a["probs"])


def test_a_killed_client_leaves_nothing_behind(tiny_daemon: DaemonProcess) -> None:
    killed = subprocess.run(
        [sys.executable, "-c", KILLED, str(tiny_daemon.socket)], capture_output=True, text=True, timeout=60
    )
    assert killed.returncode == -9 and "(1, 4)" in killed.stdout, killed.stderr
    # A new program using the same model and input works at once...
    again = subprocess.run(
        [sys.executable, "-c", KILLED.replace("os.kill(os.getpid(), signal.SIGKILL)", ""), str(tiny_daemon.socket)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 0 and "(1, 4)" in again.stdout, again.stderr
    # ...and the killed one's region is released by the daemon, its object gone from /dev/shm.
    with tiny_daemon.client() as c:
        wait_for(lambda: c.shm_status() == [], 10, what="the killed client's region to be released")
    pid = killed.stdout.split()[0]
    assert [n for n in os.listdir("/dev/shm") if n.startswith(f"edged-{pid}-")] == []


def test_regions_are_released_at_interpreter_exit(tiny_daemon: DaemonProcess) -> None:
    script = KILLED.replace("os.kill(os.getpid(), signal.SIGKILL)", "import edged.client as m; m._kept = c")
    done = subprocess.run([sys.executable, "-c", script, str(tiny_daemon.socket)], capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    with tiny_daemon.client() as c:
        assert c.shm_status() == []  # unregistered by the exit handler, not reaped later


def test_async_client_never_reads_a_cancelled_requests_answer(
    daemon_factory: Callable[..., DaemonProcess], model_dir: Path, tmp_path: Path
) -> None:
    # The answer comes late, reliably: the model's worker hangs on the request while the
    # test-only wedge's file exists (edged/lifecycle/faults.py), and answers once it is gone.
    wedge = tmp_path / "wedge"
    d = daemon_factory(
        {"tiny": {"path": str(model_dir / "tiny.onnx")}},
        extra={"server": {"inline_threshold_us": 0}},  # on its worker, which the wedge holds
        env={"EDGED_TEST_WEDGE": str(wedge)},
    ).start()
    slow, fast = np.full((1, 16), -3, np.float32), np.full((1, 16), 3, np.float32)

    async def main() -> tuple[np.ndarray, np.ndarray]:
        c = AsyncClient(str(d.socket))
        try:
            want = (await c.infer("tiny", {"x": fast}))["probs"]
            wedge.touch()
            try:
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(c.infer("tiny", {"x": slow}), 0.5)
            finally:
                wedge.unlink()
            got = (await c.infer("tiny", {"x": fast}))["probs"]
            return want, got
        finally:
            await c.close()

    want, got = asyncio.run(main())
    assert np.array_equal(got, want)  # not the stale answer to the cancelled request


def test_client_stays_light() -> None:
    code = (
        "import sys, edged.client; "
        "heavy = [m for m in ('msgspec', 'onnx', 'onnxruntime', 'uvicorn', 'edged.config') if m in sys.modules]; "
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr
