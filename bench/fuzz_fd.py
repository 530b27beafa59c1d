"""Fuzz the descriptor socket (``<socket>.fd``, sealed memfd regions) of a live daemon, beside the
HTTP fuzzing of bench.fuzz: random messages (registrations valid and not, JSON of the wrong
shape, bytes, oversized) with random descriptors (sealed and unsealed memfds of random sizes and
seals, pipes, /dev/null, none, several). Counted: answers by code, connections the daemon closed,
regions registered; and the daemon's open descriptors before and after (none may be left over).
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import os
import random
import socket
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import orjson

from edged.client import Client

SEALS = [
    0,
    fcntl.F_SEAL_SHRINK,
    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL,
    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE,
    fcntl.F_SEAL_GROW,
]


class FdResults:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.codes: Counter[str] = Counter()
        self.closed_by_daemon = 0


def _memfd(rng: random.Random) -> int:
    fd = os.memfd_create("fuzz", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, rng.choice([0, 1, 4095, 4096, 65536, rng.randrange(1, 1 << 20)]))
    seals = rng.choice(SEALS)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _pipe(rng: random.Random) -> int:
    r, w = os.pipe()
    os.close(w)
    return r


def _devnull(rng: random.Random) -> int:
    return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)


MAKERS: list[Callable[[random.Random], int]] = [_memfd, _memfd, _memfd, _pipe, _devnull]


def _message(rng: random.Random, n: int) -> bytes:
    size = rng.choice([0, 1, 64, 4096, 65536, 1 << 20, rng.randrange(-5, 1 << 21)])
    doc: Any = {"name": f"fz{n % 50}", "byte_size": size, "offset": rng.choice([0, 0, 1, 4096, -1])}
    roll = rng.random()
    if roll < 0.1:
        doc = rng.choice([[], "x", 1, None, {"name": 1, "byte_size": 1}, {"name": "a" * 300, "byte_size": 1}])
    elif roll < 0.2:
        doc["extra"] = True
    elif roll < 0.25:
        doc["byte_size"] = str(size)
    raw = orjson.dumps(doc)
    roll = rng.random()
    if roll < 0.05:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64)))
    if roll < 0.08:
        return raw + b" " * rng.choice([4096, 10_000])
    return raw


def fd_worker(path: str, api: str, seed: int, cases: int, out: FdResults) -> None:
    rng = random.Random(seed)
    sock: socket.socket | None = None
    mine: set[str] = set()
    for n in range(cases):
        if sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.settimeout(30)
            sock.connect(path)
        fds = [rng.choice(MAKERS)(rng) for _ in range(rng.choice([0, 1, 1, 1, 1, 2, 5, 20]))]
        try:
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
            sock.sendmsg([_message(rng, n)], anc)
            answer = sock.recv(4096)
            code = "closed" if not answer else str(orjson.loads(answer).get("code", "registered"))
        except OSError:
            code = "closed"
        finally:
            for fd in fds:
                os.close(fd)
        if code == "closed":
            with contextlib.suppress(OSError):
                sock.close()
            sock = None
        with out.lock:
            out.codes[code] += 1
            out.closed_by_daemon += code == "closed"
        if code == "registered":
            mine.add(f"fz{n % 50}")
        if n % 100 == 99:  # stay under the region limits, so that registrations keep being tried
            with Client(api) as c:
                for name in mine:  # only these: the HTTP fuzzing's region is this process's too
                    c.unregister_shm(name)
            mine.clear()
    if sock is not None:
        sock.close()


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def summary(out: FdResults, fds_before: int, fds_after: int) -> dict[str, Any]:
    return {
        "cases": sum(out.codes.values()),
        "by_code": dict(out.codes.most_common()),
        "closed_by_daemon": out.closed_by_daemon,
        "daemon_fds_before": fds_before,
        "daemon_fds_after": fds_after,
    }
