"""Sealed memfd regions on a real daemon: handed over the descriptor socket, mapped, used in place;
and what a hostile client can send there (wrong descriptors, several, none, garbage)."""

from __future__ import annotations

import array
import fcntl
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import orjson
import pytest

from edged import errors
from edged.client import Client, MemfdRegion, ShmRegion
from tests.helpers import FREEZE_S, DaemonProcess, HealthProber, wait_for

pytestmark = pytest.mark.integration

X = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)
SEALED = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


@pytest.fixture
def tiny(daemon_factory: Callable[..., DaemonProcess], model_dir: Path) -> DaemonProcess:
    return daemon_factory({"tiny": {"path": str(model_dir / "tiny.onnx"), "backend": "onnxruntime"}}).start()


def fd_path(d: DaemonProcess) -> str:
    return str(d.socket) + ".fd"


def memfd(size: int, seals: int = SEALED, data: bytes = b"") -> int:
    fd = os.memfd_create("edged-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if data:
        os.pwrite(fd, data, 0)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def pipe_read_end() -> int:
    r, w = os.pipe()
    os.close(w)
    return r


def send(d: DaemonProcess, msg: bytes, fds: list[int]) -> dict[str, Any]:
    """One message on the descriptor socket; the daemon's answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(10)
        s.connect(fd_path(d))
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        s.sendmsg([msg], anc)
        answer: dict[str, Any] = orjson.loads(s.recv(4096))
        return answer


def register_msg(name: str, size: int, offset: int = 0) -> bytes:
    return orjson.dumps({"name": name, "byte_size": size, "offset": offset})


def shm_input(region: str, nbytes: int = 64) -> dict[str, Any]:
    return {
        "name": "x",
        "shape": [1, 16],
        "datatype": "FP32",
        "parameters": {"shared_memory_region": region, "shared_memory_byte_size": nbytes},
    }


def infer(c: Client, doc: dict[str, Any]) -> tuple[int, Any]:
    status, data, _ = c.request(
        "POST", "/v2/models/tiny/infer", orjson.dumps(doc), {"Content-Type": "application/json"}
    )
    return status, orjson.loads(data)


def daemon_maps(d: DaemonProcess) -> str:
    assert d.proc is not None
    return Path(f"/proc/{d.proc.pid}/maps").read_text()


def daemon_fds(d: DaemonProcess) -> int:
    assert d.proc is not None
    return len(os.listdir(f"/proc/{d.proc.pid}/fd"))


def held(d: DaemonProcess) -> set[tuple[int, int]]:
    """(device, inode) of every descriptor the daemon holds open."""
    assert d.proc is not None
    out = set()
    for fd in os.listdir(f"/proc/{d.proc.pid}/fd"):
        try:
            st = os.stat(f"/proc/{d.proc.pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        out.add((st.st_dev, st.st_ino))
    return out


def reference(model: Path, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def test_the_client_hands_over_a_sealed_memfd_and_both_tensors_travel_in_place(
    tiny: DaemonProcess, model_dir: Path
) -> None:
    with tiny.client() as c:
        inp, out = c.shm_region("in", X.nbytes), c.shm_region("out", 16)
        assert isinstance(inp, MemfdRegion) and isinstance(out, MemfdRegion)
        with pytest.raises(PermissionError):  # the seal that makes a mapping safe: nobody can shrink it
            os.ftruncate(inp._fd if inp._fd >= 0 else memfd(64), 0)
        assert [r["key"] for r in c.shm_status()] == ["memfd", "memfd"]
        doc = {
            "inputs": [{**shm_input("in"), "parameters": inp.put(X).meta("x")["parameters"]}],
            "outputs": [
                {"name": "probs", "parameters": {"shared_memory_region": "out", "shared_memory_byte_size": 16}}
            ],
        }
        for x in (X, -X):  # the second frame is written into the same mapping: read where it lies
            inp.put(x)
            status, answer = infer(c, doc)
            assert status == 200, answer
            assert answer["outputs"][0]["parameters"]["shared_memory_region"] == "out"
            got = out.read(np.float32, (1, 4))
            np.testing.assert_allclose(got, reference(model_dir / "tiny.onnx", x), rtol=1e-5, atol=1e-6)
        assert "memfd:edged-in" in daemon_maps(tiny)
        c.unregister_shm("in")
        wait_for(lambda: "memfd:edged-in" not in daemon_maps(tiny), 10, what="the daemon unmaps an unregistered region")
        status, answer = infer(c, doc)
        assert (status, answer["code"]) == (400, "shm_region_not_found")


def test_infer_shm_uses_memfd_regions_and_falls_back_where_the_daemon_has_no_descriptor_socket(
    daemon_factory: Callable[..., DaemonProcess], model_dir: Path
) -> None:
    expected = reference(model_dir / "tiny.onnx", X)
    models = {"tiny": {"path": str(model_dir / "tiny.onnx"), "backend": "onnxruntime"}}
    on = daemon_factory(models).start()
    off = daemon_factory(models, extra={"server": {"memfd_socket": False}}, name="nofd").start()
    assert stat.S_ISSOCK(os.stat(fd_path(on)).st_mode) and not os.path.exists(fd_path(off))
    for d, kind in ((on, MemfdRegion), (off, ShmRegion)):
        with d.client() as c:
            np.testing.assert_allclose(c.infer_shm("tiny", {"x": X})["probs"], expected, rtol=1e-5, atol=1e-6)
            assert all(isinstance(r, kind) for r in c._shm.by_name.values())


def test_the_descriptor_socket_has_the_api_sockets_mode_and_is_removed_at_stop(tiny: DaemonProcess) -> None:
    api, fds = os.stat(tiny.socket), os.stat(fd_path(tiny))
    assert stat.S_IMODE(fds.st_mode) == stat.S_IMODE(api.st_mode) == 0o660
    assert fds.st_gid == api.st_gid
    tiny.stop()
    assert not os.path.exists(fd_path(tiny))


@pytest.mark.parametrize(
    ("what", "make", "needle"),
    [
        ("an unsealed memfd", lambda tmp: memfd(64, seals=0, data=X.tobytes()), "F_SEAL_SHRINK"),
        ("a regular file", lambda tmp: os.open(tmp / "f", os.O_RDWR | os.O_CREAT, 0o600), "memfd"),
        ("a pipe", lambda tmp: pipe_read_end(), "not a memfd"),
        ("a socket", lambda tmp: socket.socket().detach(), "not a memfd"),
    ],
)
def test_a_descriptor_that_could_shrink_under_a_mapping_is_refused(
    tiny: DaemonProcess, tmp_path: Path, what: str, make: Callable[[Path], int], needle: str
) -> None:
    if what == "a regular file":
        (tmp_path / "f").write_bytes(bytes(64))
    fd = make(tmp_path)
    try:
        answer = send(tiny, register_msg("r", 64), [fd])
    finally:
        os.close(fd)
    assert answer["code"] == "shm_invalid" and needle in answer["error"], (what, answer)
    with tiny.client() as c:
        assert c.shm_status() == []
        assert c.infer("tiny", {"x": X})["probs"].shape == (1, 4)


def test_a_region_past_the_memfds_end_or_over_the_size_limit_is_refused(
    daemon_factory: Callable[..., DaemonProcess], model_dir: Path
) -> None:
    d = daemon_factory(
        {"tiny": {"path": str(model_dir / "tiny.onnx"), "backend": "onnxruntime"}},
        extra={"server": {"max_region_size": "1MiB", "max_regions_per_peer": 1}},
    ).start()
    fd = memfd(4096)
    try:
        answer = send(d, register_msg("r", 4096, offset=1), [fd])
        assert answer["code"] == "shm_invalid" and "exceeds the memfd's 4096 bytes" in answer["error"]
        answer = send(d, register_msg("r", 2 << 20), [fd])
        assert answer["code"] == "shm_too_large"
        # The limits count regions of both kinds, per process.
        with d.client() as c:
            c.shm_region("first", 64)
            with pytest.raises(Exception, match="max_regions_per_peer"):
                c.shm_region("second", 64)
    finally:
        os.close(fd)


def test_every_descriptor_of_a_refused_message_is_closed(tiny: DaemonProcess) -> None:
    before = daemon_fds(tiny)
    fds = [memfd(64) for _ in range(10)] + [pipe_read_end() for _ in range(10)]
    ours = {(st.st_dev, st.st_ino) for st in map(os.fstat, fds)}
    try:
        # two, three, then twenty (more than the daemon has room for: MSG_CTRUNC): refused whole
        for sent in (fds[:2], fds[:3], fds):
            answer = send(tiny, register_msg("r", 64), sent)
            assert answer["code"] == "bad_request" and "exactly one descriptor" in answer["error"], answer
    finally:
        for fd in fds:
            os.close(fd)
    # Each descriptor the daemon still holds, against the ones sent: none of them may be left.
    # (A count alone would race with the daemon closing the fixture's own connections meanwhile.)
    wait_for(lambda: not held(tiny) & ours, 10, what="the daemon holding none of the descriptors sent")
    # The daemon closes the test's own connections when it reads their end: on a loaded machine
    # that can come after the check above, so the count is waited for too, against the same
    # deadline.
    wait_for(lambda: daemon_fds(tiny) <= before, 10, what=f"the daemon back to {before} descriptors")


@pytest.mark.parametrize(
    ("msg", "with_fd", "needle"),
    [
        (register_msg("r", 64), False, "exactly one descriptor"),
        (b"not json", True, "JSON"),
        (b"[1, 2]", True, "JSON object"),
        (orjson.dumps({"name": "r", "byte_size": "64"}), True, "integers"),
        (orjson.dumps({"name": "r", "byte_size": 64, "key": "/x"}), True, "unknown keys"),
        (orjson.dumps({"name": "", "byte_size": 64}), True, "name of 1 to"),
        (b"{" + b" " * 8192 + b"}", True, "at most 4096 bytes"),
    ],
)
def test_a_malformed_message_gets_a_precise_answer(tiny: DaemonProcess, msg: bytes, with_fd: bool, needle: str) -> None:
    fd = memfd(64)
    try:
        answer = send(tiny, msg, [fd] if with_fd else [])
    finally:
        os.close(fd)
    assert needle in answer["error"], answer
    with tiny.client() as c:
        assert c.shm_status() == []


def test_a_write_sealed_memfd_holds_inputs_only(tiny: DaemonProcess) -> None:
    fd = memfd(64, seals=SEALED & ~fcntl.F_SEAL_SEAL, data=X.tobytes())
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL)
    try:
        assert send(tiny, register_msg("ro", 64), [fd]) == {"registered": "ro"}
    finally:
        os.close(fd)
    with tiny.client() as c:
        status, answer = infer(c, {"inputs": [shm_input("ro")]})
        assert status == 200, answer
        out = {"name": "probs", "parameters": {"shared_memory_region": "ro", "shared_memory_byte_size": 16}}
        status, answer = infer(c, {"inputs": [shm_input("ro")], "outputs": [out]})
        assert (status, answer["code"]) == (400, "shm_invalid") and "sealed against writing" in answer["error"]


def test_only_the_process_that_handed_the_memfd_over_can_use_it_and_its_exit_releases_it(tiny: DaemonProcess) -> None:
    script = (
        "import sys, numpy as np\n"
        "from edged.client import Client\n"
        "c = Client(sys.argv[1])\n"
        "r = c.shm_region('theirs', 64)\n"
        "r.put(np.zeros((1, 16), np.float32))\n"
        "print('ready', flush=True)\n"
        "sys.stdin.readline()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(tiny.socket)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        assert "memfd:edged-theirs" in daemon_maps(tiny)
        with tiny.client() as c:  # another process of the same user: the name is not its
            status, answer = infer(c, {"inputs": [shm_input("theirs")]})
            assert (status, answer["code"]) == (400, "shm_region_not_found")
        child.kill()  # no unregistering: the daemon notices the exit itself
        child.wait(10)
        wait_for(
            lambda: "memfd:edged-theirs" not in daemon_maps(tiny), 10, what="the region of an exited process unmapped"
        )
    finally:
        child.kill()
        child.wait(10)


def test_connections_beyond_the_limit_are_refused_and_the_others_still_served(
    daemon_factory: Callable[..., DaemonProcess], model_dir: Path
) -> None:
    d = daemon_factory(
        {"tiny": {"path": str(model_dir / "tiny.onnx"), "backend": "onnxruntime"}},
        extra={"server": {"max_connections": 2}},
    ).start()
    held = [socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(2)]
    try:
        for s in held:
            s.connect(fd_path(d))
        extra = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        extra.settimeout(10)
        extra.connect(fd_path(d))  # accepted by the kernel, closed by the daemon
        assert extra.recv(4096) == b""
        extra.close()
        fd = memfd(64)
        try:
            held[0].settimeout(10)
            held[0].sendmsg([register_msg("r", 64)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
            assert orjson.loads(held[0].recv(4096)) == {"registered": "r"}
        finally:
            os.close(fd)
    finally:
        for s in held:
            s.close()


def test_regions_of_both_kinds_count_against_the_total_bytes_limit(
    daemon_factory: Callable[..., DaemonProcess], model_dir: Path
) -> None:
    d = daemon_factory(
        {"tiny": {"path": str(model_dir / "tiny.onnx"), "backend": "onnxruntime"}},
        extra={"server": {"max_region_bytes": "64KiB"}},
    ).start()
    with d.client() as c, Client(str(d.socket), memfd=False) as posix:
        c.shm_region("a", 32 * 1024)
        posix.shm_region("b", 16 * 1024)
        with pytest.raises(errors.SharedMemoryLimitError, match="server.max_region_bytes"):
            c.shm_region("c", 32 * 1024)
        c.unregister_shm("a")
        c.shm_region("c", 32 * 1024)  # what an unregistration gives back is usable again


def test_a_region_is_faulted_in_before_its_registration_is_answered(tiny: DaemonProcess) -> None:
    size = 4 << 20
    with tiny.client() as c:
        c.shm_region("frame", size)
        assert tiny.proc is not None
        smaps = Path(f"/proc/{tiny.proc.pid}/smaps").read_text().split("\n")
        at = next(i for i, line in enumerate(smaps) if "memfd:edged-frame" in line)
        rss_kib = next(int(line.split()[1]) for line in smaps[at:] if line.startswith("Rss:"))
        assert rss_kib >= size // 1024, f"{rss_kib} KiB resident of {size // 1024}"


# Large enough that faulting it in takes far longer than a health check, on any machine.
POPULATED = 512 << 20


def test_faulting_a_large_region_in_does_not_stall_the_loop(
    daemon_factory: Callable[..., DaemonProcess], model_dir: Path
) -> None:
    """The daemon faults a region in before it answers the registration, on a thread that lets go
    of the interpreter's lock. Done on the loop, or holding the lock, the populate would hold a
    health check for as long as it takes: the slowest is held to half the registration's own
    time (two figures of this run, whatever the machine)."""
    d = daemon_factory(
        {"tiny": {"path": str(model_dir / "tiny.onnx"), "backend": "onnxruntime"}},
        extra={"server": {"max_region_size": "512MiB"}},
    ).start()
    fd = memfd(POPULATED, seals=0)
    try:
        os.posix_fallocate(fd, 0, POPULATED)  # allocated by the client: the daemon faults it all in
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALED)
        with HealthProber(d.socket).running() as prober:  # answering before the registration is sent
            started = time.monotonic()
            assert send(d, register_msg("big", POPULATED), [fd]) == {"registered": "big"}
            registration_s = time.monotonic() - started
    finally:
        os.close(fd)
    assert "memfd:edged-test" in daemon_maps(d)
    print(
        f"\nslowest health check {prober.worst * 1000:.1f} ms during a registration of {registration_s * 1000:.0f} ms"
    )
    assert prober.worst < min(registration_s / 2, FREEZE_S), (
        f"a health check waited {prober.worst * 1000:.0f} ms during a registration of {registration_s * 1000:.0f} ms"
    )


def test_one_user_cannot_hold_every_connection(tiny: DaemonProcess) -> None:
    from edged.transports.shm.memfd_socket import MAX_PER_UID

    held = [socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(MAX_PER_UID)]
    try:
        for s in held:
            s.connect(fd_path(tiny))
        # Each held one is registered by the daemon before the next is refused: wait on the answer
        # of the last one, which the daemon gives only to a connection it accepted.
        fd = memfd(64)
        try:
            held[-1].settimeout(10)
            held[-1].sendmsg([register_msg("r", 64)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
            assert orjson.loads(held[-1].recv(4096)) == {"registered": "r"}
        finally:
            os.close(fd)
        extra = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        extra.settimeout(10)
        extra.connect(fd_path(tiny))
        assert extra.recv(4096) == b""  # closed by the daemon: over the per-user limit
        extra.close()
    finally:
        for s in held:
            s.close()
