"""Triton's own Python example clients (simple_http_* and simple_grpc_*, from
github.com/triton-inference-server/client, src/python/examples), run unchanged as subprocesses
against a real daemon serving the models they expect (tests/triton_models.py), only their URL
(``-u``) changed.

The examples are third-party code and never part of this repository: the test finds them through
``EDGED_TRITON_EXAMPLES`` (a checkout's ``src/python/examples``) and fails without it. It is marked
``triton_examples`` and deselected by pytest's default options (CI cannot reach GitHub); run it
with ``EDGED_TRITON_EXAMPLES=... pytest -m triton_examples tests/integration/test_triton_examples.py``.
docs/triton-migration.md lists the examples this runs and why the others are not run.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.bridge import Bridge
from tests.helpers import DaemonProcess, write_config
from tests.triton_models import example_repository

pytestmark = [pytest.mark.integration, pytest.mark.triton_examples]


@dataclass(frozen=True)
class Example:
    script: str
    # Which of the daemon's listeners its -u names: "http" (TCP), "http-local" (TCP bridged to the
    # Unix socket: shared memory needs a local peer), "grpc" (TCP), "grpc-local" (the gRPC socket).
    url: str
    # What the example prints when every check it makes passed ("" where it prints no verdict
    # and only its exit status says).
    passed: str = ""
    # Whether it counts eight models in the repository index (the others expect seven).
    eighth: bool = False


EXAMPLES = [
    Example("simple_http_infer_client.py", "http"),
    Example("simple_http_async_infer_client.py", "http"),
    Example("simple_http_aio_infer_client.py", "http", "PASS: infer"),
    Example("simple_http_string_infer_client.py", "http", "PASS: string"),
    Example("simple_http_shm_client.py", "http-local", "PASS: system shared memory"),
    Example("simple_http_shm_string_client.py", "http-local", "PASS: system shared memory"),
    Example("simple_http_health_metadata.py", "http"),
    Example("reuse_infer_objects_client.py", "http-local"),
    Example("simple_grpc_infer_client.py", "grpc", "PASS: infer"),
    Example("simple_grpc_async_infer_client.py", "grpc", "PASS: Async infer"),
    Example("simple_grpc_aio_infer_client.py", "grpc", "PASS: grpc aio infer"),
    Example("simple_grpc_string_infer_client.py", "grpc", "PASS: string"),
    Example("simple_grpc_shm_client.py", "grpc-local", "PASS: system shared memory"),
    Example("simple_grpc_shm_string_client.py", "grpc-local", "PASS: system shared memory"),
    Example("simple_grpc_health_metadata.py", "grpc"),
    Example("simple_grpc_custom_args_client.py", "grpc", "PASS: CustomArgs"),
    Example("simple_grpc_keepalive_client.py", "grpc", "PASS: KeepAlive"),
    Example("grpc_explicit_int_content_client.py", "grpc", "PASS: explicit int"),
    Example("grpc_explicit_int8_content_client.py", "grpc", "PASS: explicit int8"),
    Example("grpc_explicit_byte_content_client.py", "grpc", "PASS: explicit string"),
    # Last: both unload `simple` at their end (each loads it again first).
    Example("simple_http_model_control.py", "http", "PASS: model control"),
    Example("simple_grpc_model_control.py", "grpc", "PASS: model control", eighth=True),
]


def examples_folder() -> Path:
    where = os.environ.get("EDGED_TRITON_EXAMPLES", "")
    if not where or not (Path(where) / "simple_http_infer_client.py").is_file():
        pytest.fail(
            "EDGED_TRITON_EXAMPLES must name the src/python/examples folder of a checkout of "
            f"github.com/triton-inference-server/client (got {where!r})"
        )
    return Path(where)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Served:
    daemon: DaemonProcess
    urls: dict[str, str]


@contextmanager
def serving(tmp: Path, eighth: bool) -> Iterator[Served]:
    """A daemon serving the examples' repository on every listener they name."""
    http, grpc = free_port(), free_port()
    sock = tmp / "edged.sock"
    cfg = write_config(
        tmp / "edged.toml",
        {
            "server": {
                # Triton's health and metadata examples check the server's name.
                "metadata_name": "triton",
                "socket": str(sock),
                "tcp": [f"127.0.0.1:{http}"],
                "grpc_tcp": [f"127.0.0.1:{grpc}"],
                "model_repository": str(example_repository(tmp / "repository", eighth)),
            },
            "cache": {"dir": str(tmp / "cache")},
            "build": {"block_ready": True},
        },
    )
    d = DaemonProcess(cfg, sock, tmp / "edged.log").start()
    bridge = Bridge(sock)
    urls = {
        "http": f"127.0.0.1:{http}",
        "http-local": f"127.0.0.1:{bridge.port}",
        "grpc": f"127.0.0.1:{grpc}",
        "grpc-local": f"unix:{sock}.grpc",  # [server] grpc_socket's default
    }
    try:
        yield Served(d, urls)
    finally:
        bridge.close()
        assert d.stop() == 0, d.log()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serving(tmp_path_factory.mktemp("examples"), eighth=False) as s:
        yield s


@pytest.fixture(scope="module")
def served_eight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """Started only for the examples that count eight models."""
    with serving(tmp_path_factory.mktemp("examples8"), eighth=True) as s:
        yield s


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.script.removesuffix(".py") for e in EXAMPLES])
def test_example_passes(request: pytest.FixtureRequest, example: Example) -> None:
    served: Served = request.getfixturevalue("served_eight" if example.eighth else "served")
    script = examples_folder() / example.script
    run = subprocess.run(
        [sys.executable, str(script), "-u", served.urls[example.url]],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=script.parent,
        check=False,
    )
    said = f"exit {run.returncode}\n--- stdout ---\n{run.stdout[-4000:]}\n--- stderr ---\n{run.stderr[-4000:]}"
    assert run.returncode == 0, said
    if example.passed:
        assert example.passed in run.stdout, said
    else:  # some exit 0 after printing an error (a client that could not be made)
        assert "error" not in run.stdout.lower() and "failed" not in run.stdout.lower(), said
