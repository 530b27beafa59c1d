"""Real second and third users for the cross-user tests: created with useradd, removed after.

The test's Python lives under /root (not readable by other users), so code runs as another user
by forking this interpreter (everything it needs already imported) and dropping to that user's
uid, gid and groups in the child, exactly as a process of that user would connect.
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import secrets
import signal
import subprocess
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from tests.helpers import unavailable


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int


def need_root() -> None:
    if os.geteuid() != 0:
        unavailable("creating users (useradd/userdel) needs root")


@contextlib.contextmanager
def temp_group() -> Iterator[str]:
    name = f"edgt{secrets.token_hex(3)}"
    subprocess.run(["groupadd", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["groupdel", name], check=False)


@contextlib.contextmanager
def temp_user(groups: tuple[str, ...] = ()) -> Iterator[User]:
    name = f"edgt{secrets.token_hex(3)}"
    cmd = ["useradd", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin"]
    if groups:
        cmd += ["--groups", ",".join(groups)]
    subprocess.run([*cmd, name], check=True)
    try:
        pw = pwd.getpwnam(name)
        yield User(name, pw.pw_uid, pw.pw_gid)
    finally:
        subprocess.run(["userdel", name], check=False)


class AsUser:
    """A forked child running as ``user``: ``call(fn)`` runs fn there and returns its JSON result.
    The child stays alive between calls (so the daemon sees one process), until ``close``."""

    def __init__(self, user: User, fns: list[Callable[[], Any]], extra_groups: tuple[str, ...] = ()) -> None:
        self.user = user
        cmd_r, self._cmd_w = os.pipe()
        self._res_r, res_w = os.pipe()
        self._fns = list(fns)  # known before the fork: the child runs them by index
        groups = [user.gid, *(grp.getgrnam(g).gr_gid for g in extra_groups)]
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - the child
            os.close(self._cmd_w)
            os.close(self._res_r)
            code = 1
            try:
                _close_other_fds({cmd_r, res_w})  # others' pipes must see EOF when their parent closes them
                os.setgroups(groups)
                os.setgid(user.gid)
                os.setuid(user.uid)
                self._serve(cmd_r, res_w)
                code = 0
            finally:
                os._exit(code)
        os.close(cmd_r)
        os.close(res_w)

    def _serve(self, cmd_r: int, res_w: int) -> None:  # pragma: no cover - the child
        with os.fdopen(cmd_r, "rb") as cmds, os.fdopen(res_w, "wb", buffering=0) as out:
            for line in cmds:
                fn = self._fns[int(line)]
                try:
                    result = {"ok": fn()}
                except BaseException as e:
                    result = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
                out.write(orjson.dumps(result) + b"\n")

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (one of those given before the fork) in the child."""
        index = self._fns.index(fn)
        os.write(self._cmd_w, f"{index}\n".encode())
        line = b""
        while not line.endswith(b"\n"):
            chunk = os.read(self._res_r, 1 << 16)
            if not chunk:
                raise AssertionError(f"the process of {self.user.name} exited")
            line += chunk
        doc = orjson.loads(line)
        if "error" in doc:
            raise AssertionError(f"as {self.user.name}: {doc['error']}\n{doc['trace']}")
        return doc["ok"]

    def close(self) -> int:
        os.close(self._cmd_w)
        os.close(self._res_r)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
        os.kill(self.pid, signal.SIGKILL)
        _, status = os.waitpid(self.pid, 0)
        raise AssertionError(f"the process of {self.user.name} did not exit; killed")


def _close_other_fds(keep: set[int]) -> None:  # pragma: no cover - runs in the forked child
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)
