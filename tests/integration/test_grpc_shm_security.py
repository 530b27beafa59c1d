"""System shared memory over gRPC is tied to the registering peer, as over HTTP: a region one
user registers on the gRPC socket cannot be seen, used, written or unregistered by another
user, whose own region under the same name is a separate one. Each user's client is a process
of that user (tests/integration/grpc_as_user.py), on a real daemon."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from tests.helpers import DaemonProcess
from tests.integration.grpc_as_user import GrpcUser
from tests.integration.users import need_root, temp_group, temp_user

pytestmark = pytest.mark.integration

X = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)


@pytest.fixture
def shm_keys() -> Iterator[list[str]]:
    keys: list[str] = []
    yield keys
    for key in keys:
        Path(f"/dev/shm/{key}").unlink(missing_ok=True)


def test_a_second_user_cannot_see_use_write_or_unregister_the_first_users_region(
    daemon_factory: Callable[..., DaemonProcess], model_dir: Path, shm_keys: list[str], open_dir: Path
) -> None:
    need_root()
    sock = open_dir / "edged.sock"
    key_a, key_b = f"edgedt-ga-{secrets.token_hex(4)}", f"edgedt-gb-{secrets.token_hex(4)}"
    shm_keys += [key_a, key_b]
    want = ort.InferenceSession(str(model_dir / "tiny.onnx")).run(None, {"x": X})[0].ravel().tolist()
    with temp_group() as group, temp_user() as alice, temp_user() as bob:
        d = daemon_factory(
            {"tiny": {"path": str(model_dir / "tiny.onnx"), "backend": "onnxruntime"}},
            extra={"server": {"socket": str(sock), "socket_group": group}},
        )
        d.socket = sock
        d.start()
        a, b = GrpcUser(alice, group, Path(f"{sock}.grpc")), GrpcUser(bob, group, Path(f"{sock}.grpc"))
        try:
            assert a(f"register input0 /{key_a} 4096") == {"ok": "registered"}
            before = a("infer input0")
            seen = {
                "status": b("status"),
                "use": b("infer input0"),
                "write": b("infer_into input0"),
                "register_her_key": b(f"register stolen /{key_a} 4096"),
                "unregister": b("unregister input0"),
                "unregister_all": b("unregister"),
                "own_under_her_name": b(f"register input0 /{key_b} 4096"),
                "own_region": b("infer input0"),
            }
            names, after = a("status"), a("infer input0")
            with d.client() as root:  # root sees every region, with the owner the kernel named
                owners = {(r["name"], r["owner_uid"]) for r in root.shm_status()}
        finally:
            a.close()
            b.close()
    np.testing.assert_allclose(before["ok"], want, rtol=1e-5)
    assert seen["status"] == {"ok": []}  # her region is invisible to him
    assert seen["use"] == {"status": "INVALID_ARGUMENT", "code": "shm_region_not_found"}  # and unusable
    assert seen["write"] == {"status": "INVALID_ARGUMENT", "code": "shm_region_not_found"}
    assert seen["register_her_key"] == {"status": "PERMISSION_DENIED", "code": "shm_forbidden"}
    assert seen["unregister"] == seen["unregister_all"] == {"ok": "unregistered"}  # touching nothing of hers
    assert seen["own_under_her_name"] == {"ok": "registered"} and seen["own_region"] == before
    assert names == {"ok": ["input0"]} and after == before  # her region, her data, untouched
    assert owners == {("input0", alice.uid), ("input0", bob.uid)}
    assert np.frombuffer(Path(f"/dev/shm/{key_a}").read_bytes()[:64], np.float32).tolist() == X.ravel().tolist()
