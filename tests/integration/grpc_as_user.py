"""A gRPC client running as another user, in a process of its own (started, not forked: a
forked child of a process with grpcio's threads inherits their locks).

    python -m tests.integration.grpc_as_user UID GID GROUPS SOCKET

Started as root, it imports everything it needs, then drops to the user (the interpreter and
its standard library are under /root, which the user cannot read) before it connects, so the
daemon's SO_PEERCRED names the user. It reads one command a line on stdin and answers each with
one JSON line: ``register NAME KEY SIZE`` (creates the object as this user when KEY is new),
``infer REGION``, ``infer_into REGION`` (the output into the region), ``status``,
``unregister [NAME]``. A refused call answers its gRPC status name and ``edged-code``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from edged.wire.proto import grpc_service_pb2 as pb
from edged.wire.proto import grpc_service_pb2_grpc as pbg

if TYPE_CHECKING:
    from tests.integration.users import User

X = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)


def _infer(stub: pbg.GRPCInferenceServiceStub, region: str, into: bool) -> Any:
    msg = pb.ModelInferRequest(model_name="tiny")
    tensor = msg.inputs.add(name="x", datatype="FP32", shape=[1, 16])
    if into:
        msg.raw_input_contents.append(X.tobytes())
        out = msg.outputs.add(name="probs")
        out.parameters["shared_memory_region"].string_param = region
        out.parameters["shared_memory_byte_size"].int64_param = 16
    else:
        tensor.parameters["shared_memory_region"].string_param = region
        tensor.parameters["shared_memory_byte_size"].int64_param = X.nbytes
    resp = stub.ModelInfer(msg, timeout=30)
    raw = resp.raw_output_contents
    return np.frombuffer(raw[0], np.float32).tolist() if raw and raw[0] else "into the region"


def _create(key: str, size: int) -> None:
    path = f"/dev/shm/{key.lstrip('/')}"
    if os.path.exists(path):
        return
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)  # this user's alone
    try:
        os.ftruncate(fd, size)
        os.pwrite(fd, X.tobytes(), 0)
    finally:
        os.close(fd)


def run(stub: pbg.GRPCInferenceServiceStub, words: list[str]) -> Any:
    op = words[0]
    if op == "register":
        name, key, size = words[1], words[2], int(words[3])
        _create(key, size)
        req = pb.SystemSharedMemoryRegisterRequest(name=name, key=key, offset=0, byte_size=size)
        stub.SystemSharedMemoryRegister(req, timeout=30)
        return "registered"
    if op in ("infer", "infer_into"):
        return _infer(stub, words[1], op == "infer_into")
    if op == "status":
        return sorted(stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest(), timeout=30).regions)
    if op == "unregister":
        req = pb.SystemSharedMemoryUnregisterRequest(name=words[1] if len(words) > 1 else "")
        stub.SystemSharedMemoryUnregister(req, timeout=30)
        return "unregistered"
    raise ValueError(f"unknown command {op!r}")


def main(argv: list[str]) -> int:
    uid, gid, groups, sock = int(argv[0]), int(argv[1]), [int(g) for g in argv[2].split(",") if g], argv[3]
    os.setgroups(groups)
    os.setgid(gid)
    os.setuid(uid)
    with grpc.insecure_channel(f"unix:{sock}") as ch:
        stub = pbg.GRPCInferenceServiceStub(ch)
        for line in sys.stdin:
            try:
                answer: Any = {"ok": run(stub, line.split())}
            except grpc.RpcError as e:
                trailing = dict(e.trailing_metadata() or ())  # type: ignore[attr-defined]
                answer = {"status": e.code().name, "code": trailing.get("edged-code")}  # type: ignore[attr-defined]
            print(json.dumps(answer), flush=True)
    return 0


class GrpcUser:
    """This module as ``user``, run from a test: one process, one connection."""

    def __init__(self, user: User, group: str, sock: Path) -> None:
        import grp

        groups = f"{user.gid},{grp.getgrnam(group).gr_gid}"
        cmd = [sys.executable, "-m", "tests.integration.grpc_as_user", str(user.uid), str(user.gid), groups, str(sock)]
        repo = Path(__file__).resolve().parents[2]
        self.proc = subprocess.Popen(cmd, cwd=repo, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def __call__(self, command: str) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the client of {command!r} exited ({self.proc.wait(30)})"
        return json.loads(line)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.proc.wait(30) == 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
