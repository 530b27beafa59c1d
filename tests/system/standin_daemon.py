"""A stand-in for ``edged serve`` under the shipped edged.service, for the system tests.

It keeps the daemon's side of the unit's contract through edged.host.systemd (socket activation,
READY=1, watchdog pings, SIGHUP → RELOADING=1 ... READY=1, SIGTERM → STOPPING=1 and exit 0) and
answers every connection with a JSON report of what the sandbox lets it do. A reload waits for
the test to write to the FIFO named by $STANDIN_RELOAD_FIFO, so the test can look at the
"reloading" state without timing anything.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import sys
import threading
from typing import Any

from edged.host import systemd as sd


def attempt(action: Any) -> str:
    """'ok', or the errno name the sandbox answered with."""
    try:
        action()
    except OSError as e:
        return errno.errorcode.get(e.errno or 0, str(e))
    return "ok"


def can_write(path: str) -> str:
    def write() -> None:
        fd = os.open(os.path.join(path, ".standin-probe"), os.O_CREAT | os.O_WRONLY, 0o600)
        os.close(fd)
        os.unlink(os.path.join(path, ".standin-probe"))

    return attempt(write)


def status_field(name: str) -> str:
    with open("/proc/self/status") as f:
        return next(line.split(":", 1)[1].strip() for line in f if line.startswith(name + ":"))


CLOSED_DEVICE = "/run/edged-test-closed-device"


def report(fds: list[int]) -> dict[str, Any]:
    paths = ("/etc", "/usr", "/opt", "/var/lib/edged", "/var/cache/edged", "/run/edged", "/tmp")
    return {
        "uid": os.getuid(),
        "gid": os.getgid(),
        "groups": sorted(os.getgroups()),
        "fds": fds,
        "watchdog": sd.watchdog_interval(),
        "notify": "fallback" if sd._sd_daemon is None else "lib",
        "env": {
            k: os.environ.get(k)
            for k in ("HOME", "EDGED_CONFIG", "CUDA_CACHE_PATH", "LISTEN_FDS", "LISTEN_PID", "JOURNAL_STREAM")
        },
        "write": {p: can_write(p) for p in paths},
        "home": attempt(lambda: os.listdir("/root")),
        "netlink": attempt(lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW).close()),
        "inet6": attempt(lambda: socket.socket(socket.AF_INET6, socket.SOCK_STREAM).close()),
        "dev_null": attempt(lambda: os.close(os.open("/dev/null", os.O_RDWR))),
        # A node of autofs's numbers that every user may open (systemd_ns.py makes it; not every
        # host has /dev/autofs): DevicePolicy=closed refuses it, else it opens or has no driver.
        "dev_closed": attempt(lambda: os.close(os.open(CLOSED_DEVICE, os.O_RDONLY))),
        "cap_eff": status_field("CapEff"),
        "no_new_privs": status_field("NoNewPrivs"),
        "seccomp": status_field("Seccomp"),
        "umask": status_field("Umask"),
    }


class StandIn:
    def __init__(self) -> None:
        self.fds = sd.listen_fds()
        if not self.fds:
            sys.exit("stand-in: no socket passed (start it through edged.socket)")
        self.listener = socket.socket(fileno=self.fds[0])
        self.hup = threading.Event()
        self.reloads = 0

    def on_hup(self, _sig: int, _frame: object) -> None:
        self.hup.set()

    def on_term(self, _sig: int, _frame: object) -> None:
        sd.stopping("stand-in stopping")
        os._exit(0)

    def reloader(self) -> None:
        while self.hup.wait():
            self.hup.clear()
            sd.reloading("stand-in reloading")
            fifo = os.environ.get("STANDIN_RELOAD_FIFO")
            if fifo:
                with open(fifo) as f:
                    f.read()
            self.reloads += 1
            sd.ready(f"stand-in reloaded {self.reloads}")

    def pinger(self, interval: float) -> None:
        stop = threading.Event()
        while not stop.wait(interval / 2):
            sd.watchdog_ping()

    def serve(self) -> None:
        signal.signal(signal.SIGHUP, self.on_hup)
        signal.signal(signal.SIGTERM, self.on_term)
        threading.Thread(target=self.reloader, daemon=True).start()
        interval = sd.watchdog_interval()
        if interval:
            threading.Thread(target=self.pinger, args=(interval,), daemon=True).start()
        body = json.dumps(report(self.fds)).encode()
        sd.ready("stand-in ready")
        while True:
            conn, _ = self.listener.accept()
            with conn:
                conn.sendall(body)


if __name__ == "__main__":
    StandIn().serve()
