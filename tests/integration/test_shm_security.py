"""Shared memory against hostile clients, on a real daemon: shrunk objects (an error for that
request, never a SIGBUS), cross-user access with two real users, region limits, and regions of
exited processes."""

from __future__ import annotations

import os
import secrets
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import orjson
import pytest

from edged.client import Client, ShmRegion
from tests.helpers import FREEZE_S, DaemonProcess, unavailable, wait_for
from tests.integration.users import AsUser, need_root, temp_group, temp_user

pytestmark = pytest.mark.integration

X = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)


def make_object(size: int, data: bytes = b"", mode: int = 0o600) -> str:
    """A POSIX shared memory object in /dev/shm, as shm_open would create it; returns its key."""
    key = f"edgedt-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(f"/dev/shm/{key}", os.O_CREAT | os.O_EXCL | os.O_RDWR, mode)
    try:
        os.ftruncate(fd, size)
        if data:
            os.pwrite(fd, data, 0)
    finally:
        os.close(fd)
    return key


@pytest.fixture
def shm_keys() -> Iterator[list[str]]:
    keys: list[str] = []
    yield keys
    for key in keys:
        try:
            os.unlink(f"/dev/shm/{key}")
        except FileNotFoundError:
            pass


def infer_body(in_region: str | None, out_region: str | None = None, out_size: int = 16) -> bytes:
    if in_region is None:
        inp: dict[str, Any] = {"name": "x", "shape": [1, 16], "datatype": "FP32", "data": X.ravel().tolist()}
    else:
        inp = {
            "name": "x",
            "shape": [1, 16],
            "datatype": "FP32",
            "parameters": {"shared_memory_region": in_region, "shared_memory_byte_size": 64},
        }
    doc: dict[str, Any] = {"inputs": [inp]}
    if out_region is not None:
        params = {"shared_memory_region": out_region, "shared_memory_byte_size": out_size}
        doc["outputs"] = [{"name": "probs", "parameters": params}]
    return orjson.dumps(doc)


def post(c: Client, path: str, doc: Any = None, body: bytes | None = None) -> tuple[int, Any]:
    raw = body if body is not None else (orjson.dumps(doc) if doc is not None else b"")
    status, data, _ = c.request("POST", path, raw, {"Content-Type": "application/json"})
    return status, orjson.loads(data) if data else None


def register(c: Client, name: str, key: str, size: int) -> tuple[int, Any]:
    return post(c, f"/v2/systemsharedmemory/region/{name}/register", {"key": key, "offset": 0, "byte_size": size})


def assert_live(d: DaemonProcess) -> None:
    """The daemon is alive and its loop not frozen: /v2/health/live answers, each time within
    FREEZE_S."""
    assert d.proc is not None, "edged was never started"
    assert d.proc.poll() is None, f"edged died ({d.proc.returncode}):\n{d.log()}"
    with d.client(timeout=30) as c:
        c.live()  # connect first: the measured requests are the loop's answers only
        for _ in range(3):
            started = time.monotonic()
            assert c.live()
            took = time.monotonic() - started
            assert took < FREEZE_S, f"/v2/health/live took {took * 1000:.0f} ms"


def reference(model: Path, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


# --- SIGBUS: a shrunk object is an error for that request, never a signal -----------------------


@pytest.fixture(params=["worker", "inline"])
def tiny(
    request: pytest.FixtureRequest, daemon_factory: Callable[..., DaemonProcess], model_dir: Path
) -> DaemonProcess:
    threshold = 0 if request.param == "worker" else 10**9
    d = daemon_factory(
        {"tiny": {"path": str(model_dir / "tiny.onnx"), "backend": "onnxruntime"}},
        extra={"server": {"inline_threshold_us": threshold}},
    ).start()
    with d.client() as c:
        assert c.status()["models"]["tiny"]["inline"] is (request.param == "inline")
    return d


def test_shrunk_input_object_is_a_400_not_sigbus(tiny: DaemonProcess, shm_keys: list[str]) -> None:
    key = make_object(4096, X.tobytes())
    shm_keys.append(key)
    with tiny.client() as c:
        assert register(c, "in", key, 4096)[0] == 200
        status, doc = post(c, "/v2/models/tiny/infer", body=infer_body("in"))
        assert status == 200, doc
        os.truncate(f"/dev/shm/{key}", 0)  # what any client may do to its own object
        status, doc = post(c, "/v2/models/tiny/infer", body=infer_body("in"))
        assert (status, doc["code"]) == (400, "shm_region_truncated"), doc
        assert "shrunk" in doc["error"]
    assert_live(tiny)
    with tiny.client() as c:
        assert c.infer("tiny", {"x": X})["probs"].shape == (1, 4)


def test_shrunk_large_input_copied_off_the_loop_is_a_400_not_sigbus(
    daemon_factory: Callable[..., DaemonProcess], tmp_path: Path, shm_keys: list[str]
) -> None:
    """An input past the loop's copy limit is copied off the loop (by the model's worker when it
    is idle, else a copier thread): a shrunk object fails there, that request alone."""
    from edged.tools.demo import make_tiny_mlp
    from edged.transports.shm.copies import INLINE_COPY_BYTES

    width = INLINE_COPY_BYTES // 4 + 1024
    d = daemon_factory({"wide": {"path": str(make_tiny_mlp(tmp_path / "wide.onnx", in_dim=width, hidden=4))}}).start()
    x = np.linspace(-1, 1, width, dtype=np.float32).reshape(1, width)
    key = make_object(x.nbytes, x.tobytes())
    shm_keys.append(key)
    inp = {"name": "x", "shape": [1, width], "datatype": "FP32"}
    body = orjson.dumps(
        {"inputs": [dict(inp, parameters={"shared_memory_region": "in", "shared_memory_byte_size": x.nbytes})]}
    )
    with d.client() as c:
        assert register(c, "in", key, x.nbytes)[0] == 200
        status, doc = post(c, "/v2/models/wide/infer", body=body)
        assert status == 200, doc
        assert np.allclose(doc["outputs"][0]["data"], c.infer("wide", {"x": x})["probs"].ravel(), atol=1e-5)
        os.truncate(f"/dev/shm/{key}", x.nbytes // 2)
        status, doc = post(c, "/v2/models/wide/infer", body=body)
        assert (status, doc["code"]) == (400, "shm_region_truncated"), doc
        assert c.infer("wide", {"x": x})["probs"].shape == (1, 4)
    assert_live(d)


def test_an_answer_that_cannot_be_written_is_a_failure_in_the_statistics(
    tiny: DaemonProcess, shm_keys: list[str]
) -> None:
    """The model ran, but its output does not fit the region named for it: the client gets a
    400, and Triton's statistics count a failure, not a success."""
    key = make_object(4096)
    shm_keys.append(key)
    with tiny.client() as c:
        assert register(c, "out", key, 4096)[0] == 200
        status, doc = post(c, "/v2/models/tiny/infer", body=infer_body(None, "out", out_size=4))
        assert status == 400, doc
        status, data, _ = c.request("GET", "/v2/models/tiny/stats")
        st = orjson.loads(data)["model_stats"][0]["inference_stats"]
        assert (st["success"]["count"], st["fail"]["count"]) == (0, 1), st
        assert post(c, "/v2/models/tiny/infer", body=infer_body(None, "out", out_size=16))[0] == 200
        st = orjson.loads(c.request("GET", "/v2/models/tiny/stats")[1])["model_stats"][0]["inference_stats"]
        assert (st["success"]["count"], st["fail"]["count"], st["compute_output"]["count"]) == (1, 1, 1), st


def test_shrunk_output_object_is_a_400_not_sigbus(tiny: DaemonProcess, shm_keys: list[str]) -> None:
    key = make_object(4096)
    shm_keys.append(key)
    with tiny.client() as c:
        assert register(c, "out", key, 4096)[0] == 200
        os.truncate(f"/dev/shm/{key}", 0)
        status, doc = post(c, "/v2/models/tiny/infer", body=infer_body(None, "out"))
        assert (status, doc["code"]) == (400, "shm_region_truncated"), doc
        assert os.stat(f"/dev/shm/{key}").st_size == 0  # not grown back by the write either
    assert_live(tiny)


def test_region_stays_bound_to_the_object_registered(tiny: DaemonProcess, shm_keys: list[str]) -> None:
    """Replacing the name in /dev/shm does not redirect a region: it keeps the object it opened."""
    key = make_object(4096, X.tobytes())
    shm_keys.append(key)
    with tiny.client() as c:
        assert register(c, "in", key, 4096)[0] == 200
        first = post(c, "/v2/models/tiny/infer", body=infer_body("in"))[1]
        os.unlink(f"/dev/shm/{key}")
        fd = os.open(f"/dev/shm/{key}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)  # empty, same name
        os.close(fd)
        status, again = post(c, "/v2/models/tiny/infer", body=infer_body("in"))
        assert status == 200 and again["outputs"] == first["outputs"]


# --- least privilege: two real users ------------------------------------------------------------


def test_a_second_user_cannot_see_use_unregister_or_reach_the_first_users_region(
    daemon_factory: Callable[..., DaemonProcess], model_dir: Path, shm_keys: list[str], open_dir: Path
) -> None:
    need_root()
    sock = str(open_dir / "edged.sock")
    key_a, key_b = f"edgedt-a-{secrets.token_hex(4)}", f"edgedt-b-{secrets.token_hex(4)}"
    shm_keys += [key_a, key_b]

    def alice_register() -> Any:
        fd = os.open(f"/dev/shm/{key_a}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)  # hers alone
        os.ftruncate(fd, 4096)
        os.pwrite(fd, X.tobytes(), 0)
        os.close(fd)
        c = Client(sock)
        assert register(c, "input0", key_a, 4096)[0] == 200
        return post(c, "/v2/models/tiny/infer", body=infer_body("input0"))[1]["outputs"][0]["data"]

    def alice_check() -> Any:
        c = Client(sock)
        names = [r["name"] for r in c.shm_status()]
        return names, post(c, "/v2/models/tiny/infer", body=infer_body("input0"))[1]["outputs"][0]["data"]

    def bob_attack() -> Any:
        c = Client(sock)
        seen: dict[str, object] = {"status": c.shm_status()}
        status, doc = post(c, "/v2/models/tiny/infer", body=infer_body("input0"))
        seen["use"] = [status, doc["code"]]
        status, doc = register(c, "stolen", key_a, 4096)
        seen["register_her_key"] = [status, doc["code"]]
        seen["unregister"] = post(c, "/v2/systemsharedmemory/region/input0/unregister")[0]
        seen["unregister_all"] = post(c, "/v2/systemsharedmemory/unregister")[0]
        fd = os.open(f"/dev/shm/{key_b}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(fd, 4096)
        os.close(fd)
        seen["own_under_her_name"] = register(c, "input0", key_b, 4096)[0]
        seen["output_into_input0"] = post(c, "/v2/models/tiny/infer", body=infer_body(None, "input0"))[0]
        try:
            os.open(f"/dev/shm/{key_a}", os.O_RDONLY)
            seen["direct_open"] = "opened"
        except PermissionError:
            seen["direct_open"] = "denied"
        return seen

    fns = [alice_register, alice_check, bob_attack]
    with temp_group() as group, temp_user() as alice, temp_user() as bob:
        d = daemon_factory(
            {"tiny": {"path": str(model_dir / "tiny.onnx"), "backend": "onnxruntime"}},
            extra={"server": {"socket": sock, "socket_group": group}},
        )
        d.socket = Path(sock)
        d.start()
        a = AsUser(alice, fns, (group,))
        b = AsUser(bob, fns, (group,))
        try:
            before = a.call(alice_register)
            seen = b.call(bob_attack)
            names, after = a.call(alice_check)
            with d.client() as root:  # root sees every region, with its owner
                owners = {(r["name"], r["owner_uid"]) for r in root.shm_status()}
        finally:
            a.close()
            b.close()
    assert seen["status"] == []  # her region is invisible to him
    assert seen["use"] == [400, "shm_region_not_found"]  # and unusable
    assert seen["register_her_key"] == [403, "shm_forbidden"]  # her 0600 object, through edged
    assert seen["unregister"] == 200 and seen["unregister_all"] == 200  # succeed, touch nothing of hers
    assert seen["own_under_her_name"] == 200 and seen["output_into_input0"] == 200
    assert seen["direct_open"] == "denied"
    assert names == ["input0"] and after == before  # her region, her data, untouched
    assert np.frombuffer(Path(f"/dev/shm/{key_a}").read_bytes()[:64], np.float32).tolist() == X.ravel().tolist()
    assert owners == {("input0", alice.uid), ("input0", bob.uid)}
    assert_live(d)


# --- limits ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("total", "per_peer", "key"), [(2, 8, "server.max_regions"), (8, 2, "server.max_regions_per_peer")]
)
def test_region_limits_are_clear_errors_and_others_are_served(
    daemon_factory: Callable[..., DaemonProcess],
    model_dir: Path,
    shm_keys: list[str],
    total: int,
    per_peer: int,
    key: str,
) -> None:
    d = daemon_factory(
        {"tiny": {"path": str(model_dir / "tiny.onnx")}},
        extra={"server": {"max_regions": total, "max_regions_per_peer": per_peer, "max_region_size": "1MiB"}},
    ).start()
    keys = [make_object(4096) for _ in range(3)]
    shm_keys += keys
    with d.client() as c, d.client() as other:
        assert register(c, "r0", keys[0], 4096)[0] == 200
        assert register(c, "r1", keys[1], 4096)[0] == 200
        status, doc = register(c, "r2", keys[2], 4096)
        assert (status, doc["code"]) == (429, "shm_limit") and key in doc["error"], doc
        assert other.infer("tiny", {"x": X})["probs"].shape == (1, 4)  # everyone else is served
        assert_live(d)
        assert post(c, "/v2/systemsharedmemory/region/r0/unregister")[0] == 200
        assert register(c, "r2", keys[2], 4096)[0] == 200  # room again
        big = make_object(2 << 20)
        shm_keys.append(big)
        status, doc = register(c, "big", big, 2 << 20)
        assert (status, doc["code"]) == (413, "shm_too_large") and "server.max_region_size" in doc["error"]


# --- regions of exited processes --------------------------------------------------------------------

HOLDER = """
import sys
from edged.client import Client
c = Client(sys.argv[1])
c.register_shm(sys.argv[2], sys.argv[3], 4096)
print("registered", flush=True)
sys.stdin.read()
"""


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_regions_of_a_killed_process_are_released(
    daemon_factory: Callable[..., DaemonProcess], model_dir: Path, shm_keys: list[str]
) -> None:
    d = daemon_factory({"tiny": {"path": str(model_dir / "tiny.onnx")}}).start()
    assert d.proc is not None
    pid = d.proc.pid
    key = make_object(4096)
    shm_keys.append(key)
    name = f"held-{secrets.token_hex(4)}"
    with d.client() as c:
        c.live()
        fds_before = fd_count(pid)
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(d.socket), name, key], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        try:
            assert holder.stdout is not None and holder.stdout.readline() == b"registered\n"
            assert any(r["name"] == name and r["owner_pid"] == holder.pid for r in c.shm_status())
        finally:
            holder.send_signal(signal.SIGKILL)  # no close(), no atexit: as a crash leaves it
            holder.wait(10)
        wait_for(lambda: all(r["name"] != name for r in c.shm_status()), 10, what="the region to be released")
        wait_for(lambda: fd_count(pid) <= fds_before, 10, what="its descriptors to be closed")


def test_client_objects_are_shared_with_the_daemon_user_alone() -> None:
    """The client creates its objects 0600 and grants the daemon's user (when edged runs as
    another user) an ACL entry: the daemon can open it, no other user can."""
    need_root()
    region = ShmRegion("acl", 4096)
    path = f"/dev/shm{region.key}"

    def can_open() -> bool:
        try:
            os.close(os.open(path, os.O_RDWR))
        except PermissionError:
            return False
        return True

    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        with temp_user() as daemon_user, temp_user() as other:
            if not region.grant(daemon_user.uid):
                unavailable("/dev/shm has no POSIX ACLs here (tmpfs without CONFIG_TMPFS_POSIX_ACL)")
            as_daemon, as_other = AsUser(daemon_user, [can_open]), AsUser(other, [can_open])
            try:
                assert as_daemon.call(can_open) is True
                assert as_other.call(can_open) is False
            finally:
                as_daemon.close()
                as_other.close()
    finally:
        region.close()
