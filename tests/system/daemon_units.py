"""The real edged daemon under the shipped units, in a systemd booted by systemd_ns.

``boot_edged`` installs systemd/edged.service (and edged.socket unless the test masks it) with
the users from systemd/edged.sysusers and /run/edged from systemd/edged.tmpfiles, as
test_shipped_units.py does, and replaces only ExecStart=: the unit runs ``python -m edged serve
--config /etc/edged/edged.toml``, this checkout's daemon. Everything else (Type=notify,
ExecReload=, WatchdogSec=, socket activation, User=edged, the directories and every hardening
line) is the shipped unit; a test adds its own lines in a second drop-in.

Paths: the unit keeps ProtectHome=yes and PrivateTmp=yes, so neither the venv's interpreter (a
symlink into /root/.pyenv) nor pytest's tmp_path (under /tmp) is visible to the daemon. The unit
therefore runs /usr/bin/python3 with this checkout and the venv's site-packages on PYTHONPATH
(unit_python.python_for_units, same CPython minor version, so the same C extensions), and the
test puts what the daemon reads where the shipped config expects it: the config in
/etc/edged (a private copy of /etc), models and calibration images under /var/lib/edged (a
tmpfs of the namespace), engines in /var/cache/edged (another tmpfs).
"""

from __future__ import annotations

import http.client
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from ns_host import REPO
from systemd_ns import Boot, BootOptions, SystemdNamespace
from unit_python import python_for_units

from edged.client import Client
from tests.helpers import write_config

UNITS = REPO / "systemd"
SERVICE = "edged.service"
SOCKET_UNIT = "edged.socket"
SOCKET = "/run/edged/edged.sock"
CONFIG = "/etc/edged/edged.toml"
STATE = "/var/lib/edged"
# Files a test uses to steer the daemon (EDGED_TEST_WEDGE): /run is visible to the service, its
# /tmp is not (PrivateTmp=yes).
TEST_RUN = "/run/edged-test"


def real_daemon_drop_in() -> str:
    python, pythonpath = python_for_units()
    return f"""[Service]
ExecStart=
ExecStart=/usr/bin/nohup {python} -m edged serve --config {CONFIG}
Environment=PYTHONPATH={pythonpath}
# The checkout may live where the hardened unit hides things (CI can clone it under /tmp).
BindReadOnlyPaths={REPO}
"""


class StrictClient(Client):
    """Client without the retry on a closed keep-alive connection: a connection the daemon drops
    in the middle of a reload is a failed request here, not a silent second attempt."""

    def request(
        self, method: str, path: str, body: bytes | None = None, headers: Mapping[str, str] | None = None
    ) -> tuple[int, bytes, http.client.HTTPResponse]:
        self._conn.request(method, path, body=body, headers=dict(headers or {}))
        resp = self._conn.getresponse()
        return resp.status, resp.read(), resp


@dataclass
class Edged:
    """edged.service in a booted namespace: its files, its socket, its systemd properties."""

    ns: SystemdNamespace

    def path(self, inside: str) -> Path:
        return self.ns.root_path(inside)

    @property
    def socket(self) -> str:
        return str(self.path(SOCKET))

    def client(self, timeout: float = 30.0) -> Client:
        return StrictClient(self.socket, timeout=timeout)

    def write_config(self, tables: dict[str, dict[str, Any]]) -> Path:
        # Engines are built before READY=1 unless a test asks for background builds.
        tables = {"build": {"block_ready": True}, **tables}
        path = self.path(CONFIG)
        path.parent.mkdir(mode=0o755, exist_ok=True)
        part = write_config(path.with_name(path.name + ".part"), tables)
        part.chmod(0o644)  # read by the user edged
        os.replace(part, path)  # the daemon never reads half a file
        return path

    def install(self, source: Path, name: str) -> str:
        """Copy a file (or a folder) under /var/lib/edged; returns its path in the namespace.
        A file replaces the old one atomically (a new inode), as a package upgrade does."""
        inside = f"{STATE}/{name}"
        dest = self.path(inside)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, dest)
        else:
            part = dest.with_name(dest.name + ".part")
            shutil.copyfile(source, part)
            part.chmod(0o644)
            os.replace(part, dest)
        return inside

    def show(self, *props: str) -> dict[str, str]:
        return self.ns.show(SERVICE, *props)

    def prop(self, name: str) -> str:
        return self.show(name)[name]

    def state(self) -> str:
        return self.ns.state(SERVICE)

    def main_pid(self) -> int:
        return int(self.prop("MainPID"))

    def start(self, timeout: float = 120) -> float:
        """``systemctl start edged.service``; returns how long it blocked (Type=notify: until
        READY=1)."""
        t0 = time.monotonic()
        self.ns.systemctl("start", SERVICE, check=True, timeout=timeout)
        return time.monotonic() - t0

    def journal(self) -> str:
        out = self.ns.run("journalctl", "--no-pager", "-o", "cat", f"_SYSTEMD_UNIT={SERVICE}")
        return out.stdout

    def diagnostics(self) -> str:
        console = self.ns.console_log.read_text(errors="replace")[-3000:]
        return (
            f"--- systemctl status ---\n{self.ns.status(SERVICE)}\n"
            f"--- daemon journal (last 4000 chars) ---\n{self.journal()[-4000:]}\n"
            f"--- PID 1 console (last 3000 chars) ---\n{console}"
        )


def boot_edged(boot: Boot, *, socket_unit: bool = True, extra: str = "") -> Edged:
    """Boot a namespace with the shipped units and users; nothing is started yet.

    ``socket_unit=False`` masks edged.socket (a /dev/null unit), so the daemon binds
    /run/edged/edged.sock itself, as docs/systemd.md describes. ``extra`` is a second drop-in
    for edged.service (a shorter WatchdogSec=, an Environment= line).
    """
    units = {
        SERVICE: (UNITS / SERVICE).read_text(),
        f"{SERVICE}.d/50-real-daemon.conf": real_daemon_drop_in(),
    }
    if socket_unit:
        units[SOCKET_UNIT] = (UNITS / SOCKET_UNIT).read_text()
    if extra:
        units[f"{SERVICE}.d/60-test.conf"] = extra
    options = BootOptions(private_etc=True, wants=(), tmpfs=("/tmp", "/var/tmp", "/var/lib", "/var/cache"))
    ns = boot(units, options)
    ns.run("systemd-sysusers", str(UNITS / "edged.sysusers"), check=True)
    ns.run("systemd-tmpfiles", "--create", str(UNITS / "edged.tmpfiles"), check=True)
    if not socket_unit:
        (ns.unit_dir / SOCKET_UNIT).symlink_to("/dev/null")  # masked
    ns.daemon_reload()  # User=edged resolves against the users just created
    ns.root_path(TEST_RUN).mkdir(mode=0o755)
    return Edged(ns)


def onnx_reference(model: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What ONNX Runtime answers for this model file here, outside the daemon."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, inputs)))


def matches(got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray]) -> bool:
    return set(got) == set(want) and all(
        got[k].shape == want[k].shape and np.allclose(got[k], want[k], rtol=1e-4, atol=1e-5) for k in want
    )


@dataclass
class Stream:
    """Clients that each send requests back to back on their own keep-alive connection until
    stopped, and classify every answer: which expected output it matched, or why it failed."""

    edged: Edged
    model: str
    inputs: dict[str, np.ndarray]
    classify: Callable[[dict[str, np.ndarray]], str]
    clients: int = 3
    answers: list[list[str]] = field(default_factory=list)  # per client, in order
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __enter__(self) -> Stream:
        for i in range(self.clients):
            self.answers.append([])
            t = threading.Thread(target=self._run, args=(self.answers[i],), name=f"stream-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)
        alive = [t.name for t in self._threads if t.is_alive()]
        assert not alive, f"client threads still running: {alive}"

    def count(self, label: str) -> int:
        with self._lock:
            return sum(seq.count(label) for seq in self.answers)

    def _run(self, answers: list[str]) -> None:
        with self.edged.client(timeout=30) as c:
            while not self._stop.is_set():
                try:
                    label = self.classify(c.infer(self.model, self.inputs))
                except Exception as e:  # every kind of failure is a finding
                    with self._lock:
                        self.failures.append(f"{type(e).__name__}: {e}")
                    return
                with self._lock:
                    answers.append(label)


def request_outcomes(edged: Edged) -> dict[tuple[str, str], float]:
    """edged_requests_total from /metrics: {(model, outcome): count}."""
    with edged.client() as c:
        status, body, _ = c.request("GET", "/metrics")
    assert status == 200, body
    counts: dict[tuple[str, str], float] = {}
    for line in body.decode().splitlines():
        if not line.startswith("edged_requests_total{"):
            continue
        labels, value = line.rsplit(" ", 1)
        pairs = dict(p.split("=", 1) for p in labels[labels.index("{") + 1 : -1].split(","))
        key = (pairs["model"].strip('"'), pairs["outcome"].strip('"'))
        counts[key] = counts.get(key, 0) + float(value)
    return counts
