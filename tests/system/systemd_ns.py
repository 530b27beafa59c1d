"""The system-test harness: a real systemd, booted as PID 1 of private namespaces.

The recipe is the one in the design brief (section 6), hardened after trying it here; see
docs/systemd.md, "How the system tests boot systemd", for what each extra step prevents:

    sh -c 'echo $$ > CGROUP/cgroup.procs; exec unshare --fork --pid --mount --cgroup --uts --ipc \
        --mount-proc --propagation private sh -c SETUP'

CGROUP is a fresh child of this process's cgroup2 cgroup, so the namespace's cgroup root is that
child and systemd's init.scope and system.slice land under it instead of in the host's root.
SETUP mounts, inside the namespace only: a tmpfs on /run, a fresh cgroup2 on /sys/fs/cgroup (the
inherited mounts show the host's hierarchy and systemd would write outside its namespace), /proc/sys
read-only (PID 1 raises fs.file-max and net.unix.max_dgram_qlen), optional tmpfs mounts and a
private copy of /etc; then it execs ``systemd --system --unit=edged-test.target`` with
SYSTEMD_UNIT_PATH naming a directory that holds only the test's units. Nothing here sleeps to
synchronise: every wait polls a condition against a deadline.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ns_console import ConsoleCapture
from ns_host import SYSTEMD, BootError, children_of, own_cgroup2_dir, remove_cgroup
from ns_waits import wait_until

log = logging.getLogger(__name__)

TARGET = "edged-test.target"
JOURNALD_UNITS = ("systemd-journald.socket", "systemd-journald.service")
# Default dependencies of services and sockets Require= sysinit.target: without it `systemctl
# start` after boot fails with "Unit sysinit.target not found" (the boot transaction tolerates it).
STUB_TARGETS = ("sysinit.target",)
BOOT_TIMEOUT = 30.0


# --- the namespace --------------------------------------------------------------------------------


@dataclass
class BootOptions:
    # journald in the namespace, as in production: services get JOURNAL_STREAM, PID 1's and the
    # units' messages can be read back with journal(); its files go to a tmpfs.
    journald: bool = True
    # Copied from the host into the work directory and bind-mounted over /etc, so systemd-sysusers,
    # tmpfiles and ConfigurationDirectory= change a copy.
    private_etc: bool = False
    # Hidden behind a tmpfs in the namespace: /tmp and /var/tmp so PrivateTmp= leftovers of a
    # killed namespace vanish with it; others as a test needs (StateDirectory=, CacheDirectory=).
    tmpfs: Sequence[str] = ("/tmp", "/var/tmp")
    # Units edged-test.target pulls in at boot; None: every unit given. A test that must prepare
    # something first (users, directories) names none and starts them itself.
    wants: Sequence[str] | None = None
    # Searched after the test's own unit directory, e.g. /etc/systemd/system for install.sh
    # (with private_etc, so what it installs lands in the copy).
    extra_unit_paths: Sequence[str] = ()


SETUP = r"""
set -eu
mount -n -t tmpfs -o mode=0755 tmpfs /run
mknod -m 0666 /run/edged-test-closed-device c 10 235  # autofs's numbers: standin_daemon.py opens it
mount -n -t cgroup2 cgroup2 /sys/fs/cgroup
mount -n --bind /proc/sys /proc/sys
mount -n -o remount,bind,ro /proc/sys
i=0
for keep in $KEEP; do
  mkdir "/run/edged-test-keep$i"; mount -n --bind "$keep" "/run/edged-test-keep$i"; i=$((i + 1))
done
if [ "$PRIVATE_ETC" = 1 ]; then cp -a /etc "$WORK/etc"; mount -n --bind "$WORK/etc" /etc; fi
for dir in $TMPFS; do [ -d "$dir" ] && mount -n -t tmpfs -o mode=1777 tmpfs "$dir"; done
i=0
for keep in $KEEP; do
  mkdir -p "$keep"; mount -n --bind "/run/edged-test-keep$i" "$keep"
  umount -n "/run/edged-test-keep$i"; rmdir "/run/edged-test-keep$i"; i=$((i + 1))
done
mount -n --bind "$CONSOLE" /dev/console
exec env -i container=edged-test SYSTEMD_UNIT_PATH="$WORK/units$UNIT_PATH_EXTRA" \
    "$SYSTEMD" --system --unit=edged-test.target --log-target=console --show-status=no
"""


@dataclass
class SystemdNamespace:
    """One booted systemd; drive it with ``systemctl``/``run``, read its journal, wait on it."""

    work: Path
    units: dict[str, str]
    # Stay visible in the namespace when its /tmp is a tmpfs: pytest's base temp directory, so
    # files a test makes in tmp_path (FIFOs, configs) are where its units expect them, and the
    # checkout itself (CI may clone it under /tmp), whose venv and units the tests run.
    keep: Path
    options: BootOptions = field(default_factory=BootOptions)
    init_pid: int = 0
    _proc: subprocess.Popen[bytes] | None = None
    _console: ConsoleCapture | None = None
    _cgroup: Path | None = None

    @property
    def unit_dir(self) -> Path:
        return self.work / "units"

    @property
    def console_log(self) -> Path:
        return self.work / "console.log"

    def root_path(self, path: str) -> Path:
        """A path inside the namespace's mounts, reachable from the host through /proc."""
        return Path(f"/proc/{self.init_pid}/root") / path.lstrip("/")

    # --- boot and teardown

    def boot(self) -> None:
        self._write_units()
        console = ConsoleCapture(self.console_log)
        self._console = console
        self._cgroup = own_cgroup2_dir() / f"edged-test-{uuid.uuid4().hex[:12]}"
        self._cgroup.mkdir()
        env = dict(
            os.environ,
            WORK=str(self.work),
            KEEP=" ".join(self._keep()),
            CONSOLE=console.tty,
            SYSTEMD=str(SYSTEMD),
            TMPFS=" ".join(self._tmpfs()),
            PRIVATE_ETC="1" if self.options.private_etc else "0",
            UNIT_PATH_EXTRA="".join(f":{p}" for p in self.options.extra_unit_paths),
        )
        outer = (
            'echo $$ > "$1/cgroup.procs" && exec unshare --fork --pid --mount --cgroup --uts '
            '--ipc --mount-proc --propagation private sh -c "$2"'
        )
        with (self.work / "setup.log").open("wb") as out:
            self._proc = subprocess.Popen(
                ["sh", "-c", outer, "sh", str(self._cgroup), SETUP],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.init_pid = wait_until(self._find_init, BOOT_TIMEOUT, "systemd to exec as PID 1")
        wait_until(self._manager_up, BOOT_TIMEOUT, "systemd's manager to answer systemctl")

    def _keep(self) -> list[str]:
        repo = Path(__file__).resolve().parents[2]
        hidden = [Path(d) for d in self._tmpfs()]
        keep = [str(self.keep)]
        if any(repo.is_relative_to(d) for d in hidden) and not repo.is_relative_to(self.keep):
            keep.append(str(repo))
        return keep

    def _tmpfs(self) -> list[str]:
        dirs = list(self.options.tmpfs)
        if self.options.journald:
            dirs.append("/var/log/journal")  # else journald would write to the host's journal
        return dirs

    def _write_units(self) -> None:
        self.unit_dir.mkdir(parents=True)
        given = [name for name in self.units if "/" not in name]
        wants = list(given if self.options.wants is None else self.options.wants)
        if self.options.journald:
            for name in JOURNALD_UNITS:
                shutil.copy(Path("/lib/systemd/system") / name, self.unit_dir / name)
            wants.insert(0, "systemd-journald.socket")
        for name in STUB_TARGETS:
            (self.unit_dir / name).write_text(f"[Unit]\nDescription=stub {name} for tests\n")
        (self.unit_dir / TARGET).write_text(f"[Unit]\nDescription=edged system test\nWants={' '.join(wants)}\n")
        for name, text in self.units.items():
            self.add_unit(name, text)

    def _find_init(self) -> int | None:
        """The namespace's PID 1, as the host sees it, once it has exec'd systemd."""
        if self._proc is None or self._proc.poll() is not None:
            raise BootError(f"the namespace exited during setup:\n{self.diagnostics()}")
        for pid in children_of(self._proc.pid):
            try:
                exe = os.readlink(f"/proc/{pid}/exe")
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            nspid = next(ln.split()[1:] for ln in status.splitlines() if ln.startswith("NSpid"))
            if exe == str(SYSTEMD.resolve()) and nspid[-1] == "1":
                return pid
        return None

    def _manager_up(self) -> bool:
        if self._proc is not None and self._proc.poll() is not None:
            raise BootError(f"systemd exited while booting:\n{self.diagnostics()}")
        return self.systemctl("show", "-p", "Version", "--value").returncode == 0

    def shutdown(self) -> None:
        """Stop the units, then kill this namespace's init by its PID and remove its cgroup."""
        if self.init_pid and self._proc is not None and self._proc.poll() is None:
            units = [TARGET, *(name for name in self.units if "/" not in name)]
            try:
                self.systemctl("stop", *units, timeout=40)
            except subprocess.TimeoutExpired:
                log.warning("stopping %s timed out; killing the namespace", units)
            os.kill(self.init_pid, signal.SIGKILL)  # PID 1 of a namespace: takes all with it
        if self._proc is not None:
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                log.warning("namespace wrapper %d outlived its init", self._proc.pid)
        if self._cgroup is not None:
            remove_cgroup(self._cgroup)
            self._cgroup = None
        if self._console is not None:
            self._console.close()
            self._console = None

    def diagnostics(self) -> str:
        parts = []
        for name in ("setup.log", "console.log"):
            path = self.work / name
            text = path.read_text(errors="replace") if path.exists() else ""
            parts.append(f"--- {name} (last 3000 chars) ---\n{text[-3000:]}")
        return "\n".join(parts)

    # --- driving

    def run(
        self, *argv: str, check: bool = False, timeout: float = 30, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a command in the namespace (its mounts and PIDs): ``nsenter -t PID -m -p``.

        The environment is a clean PATH and LANG plus ``env``: the test runner's own variables
        stay out of what runs in there.
        """
        cmd = ["nsenter", "-t", str(self.init_pid), "-m", "-p", *argv]
        base = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "LANG": "C"}
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**base, **(env or {})})
        if check and out.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
        return out

    def systemctl(self, *args: str, check: bool = False, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return self.run("systemctl", "--no-pager", "--no-ask-password", *args, check=check, timeout=timeout)

    def state(self, unit: str) -> str:
        return self.systemctl("is-active", unit).stdout.strip()

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.systemctl("show", unit, *(f"--property={p}" for p in props), check=True)
        return dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)

    def wait_state(self, unit: str, state: str, timeout: float = 20) -> None:
        def reached() -> bool:
            now = self.state(unit)
            if now == "failed" and state != "failed":
                raise AssertionError(f"{unit} failed:\n{self.status(unit)}")
            return now == state

        wait_until(reached, timeout, f"{unit} to be {state}")

    def wait_property(self, unit: str, prop: str, value: str, timeout: float = 20) -> None:
        def shown() -> bool:
            return self.show(unit, prop).get(prop) == value

        wait_until(shown, timeout, f"{unit} to show {prop}={value!r}")

    def status(self, unit: str) -> str:
        return self.systemctl("status", "--lines=30", unit).stdout

    def add_unit(self, name: str, text: str) -> None:
        """Write a unit, or a drop-in when ``name`` is ``unit.d/file.conf``."""
        path = self.unit_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if self.options.journald and "/" not in name and not name.endswith(".target"):
            drop_in = self.unit_dir / f"{name}.d" / "00-edged-test-journal.conf"
            drop_in.parent.mkdir(exist_ok=True)
            drop_in.write_text("[Unit]\nAfter=systemd-journald.socket\n")

    def daemon_reload(self) -> None:
        self.systemctl("daemon-reload", check=True, timeout=60)

    def journal(self, *match: str) -> list[dict[str, str]]:
        """Journal entries (``journalctl -o json``) that match, e.g. ``_SYSTEMD_UNIT=x.service``."""
        out = self.run("journalctl", "--no-pager", "-o", "json", "--all", *match)
        return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]

    def connect(self, path: str, timeout: float = 10) -> socket.socket:
        """A client connection to a Unix socket inside the namespace, from the host."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        sock.connect(str(self.root_path(path)))
        return sock


Boot = Callable[..., SystemdNamespace]
"""The boot_systemd fixture: ``boot(units, options=None) -> SystemdNamespace``."""
