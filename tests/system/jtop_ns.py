"""jetson-stats' real jtop service, run off-Jetson in private PID and mount namespaces.

The recipe is the one in the design brief (section 6). What jtop 7.x needs, read from its source:

- root and ``JTOP_SERVICE=True``: ``jtop`` then runs ``JtopServer`` instead of the terminal UI;
  ``--force`` only removes a stale ``/run/jtop.sock`` before starting.
- a group ``jtop`` (``grp.getgrnam``): the socket is chowned to it, mode 0660. Added to a private
  copy of /etc bind-mounted over /etc, never to the host's.
- on x86_64, ``/sys/devices/virtual/dmi/id/``: ``get_x86_64_variables`` lists every file there for
  the board's "hardware" entry, and the service dies with FileNotFoundError where the directory
  is missing (VMs such as this one). A tmpfs with a few fake files stands in for it.
- ``/run/jtop.sock``: a multiprocessing manager's socket; a tmpfs over /run keeps it private.

What else it writes, traced with ``strace -f``: ``mkdir`` of its config folder
``sys.base_prefix/local/jtop`` (the base interpreter's prefix, outside the venv), which an overlay
with a tmpfs upper layer absorbs, and POSIX semaphores in /dev/shm, which get a tmpfs of their own.
Everything private lives on tmpfs mounts of the namespace, so it vanishes with it.

The service's first process becomes PID 1 of the namespace: SIGTERM (jtop installs a handler)
closes it cleanly, and SIGKILL to it, the fallback, takes every process of the namespace along.
Nothing here sleeps to synchronise: waits poll a condition against a deadline.
"""

from __future__ import annotations

import grp
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ns_host import REPO, children_of
from ns_waits import wait_until

JTOP_SOCKET = "/run/jtop.sock"
START_TIMEOUT = 20.0
STOP_TIMEOUT = 15.0
READY_MARK = "edged-test: namespace ready"

# Fake DMI: what jtop shows as the board's "hardware" on x86_64.
FAKE_DMI = {
    "sys_vendor": "edged-test",
    "product_name": "edged test board (fake DMI)",
    "board_name": "edged-test-jtop",
}


class SetupError(RuntimeError):
    """The namespace could not be built here (mounts refused, overlay unsupported...)."""


SETUP = r"""
set -eu
mount -n -t tmpfs -o mode=0755 tmpfs /run
mount -n -t tmpfs -o mode=1777 tmpfs /dev/shm
P=/run/edged-test
mkdir "$P" "$P/etc" "$P/up" "$P/ovwork"
# A private /etc with the jtop group.
cp -a /etc/. "$P/etc/"
if [ -n "$JTOP_GID" ]; then echo "jtop:x:$JTOP_GID:" >> "$P/etc/group"; fi
mount -n --bind "$P/etc" /etc
# A fake /sys/devices/virtual/dmi/id. Where the machine has none, a tmpfs replaces
# /sys/devices/virtual (sysfs cannot mkdir) and the real entries are bind-mounted back into it.
V=/sys/devices/virtual
if [ -d "$V/dmi/id" ]; then
  mount -n -t tmpfs -o mode=0755 tmpfs "$V/dmi/id"
else
  mkdir "$P/virtual"
  mount -n --bind "$V" "$P/virtual"
  mount -n -t tmpfs -o mode=0755 tmpfs "$V"
  for d in "$P"/virtual/*; do
    n=${d##*/}; mkdir "$V/$n"; mount -n --bind "$d" "$V/$n"
  done
  umount -n "$P/virtual"; rmdir "$P/virtual"
  mkdir -p "$V/dmi/id"
fi
cp "$DMI_SRC"/* "$V/dmi/id/"
# jtop's config folder: writes go to an overlay whose upper layer is on the /run tmpfs.
mount -n -t overlay overlay -o "lowerdir=$CONFIG_BASE,upperdir=$P/up,workdir=$P/ovwork" "$CONFIG_BASE"
echo "$READY_MARK"
exec env -i PATH="$PATH" LANG=C PYTHONDONTWRITEBYTECODE=1 JTOP_SERVICE=True "$@"
"""


# --- prerequisites ------------------------------------------------------------------------------


def jtop_command() -> list[str]:
    """The service's command line: jetson-stats' ``jtop`` script beside this interpreter."""
    script = Path(sys.executable).parent / "jtop"
    if script.exists():
        return [str(script), "--force"]
    return [sys.executable, "-m", "jtop", "--force"]


def jtop_config_dir() -> Path:
    """Where jtop's service keeps its config (``sys.base_prefix/local/jtop`` in jtop 7.x)."""
    from jtop.core.config import get_config_service

    return Path(get_config_service())


def overlay_base(config_dir: Path) -> Path:
    """The deepest existing folder on the way to ``config_dir``: the overlay goes over it."""
    path = config_dir
    while not path.is_dir():
        path = path.parent
    return path


def missing_prerequisite() -> str | None:
    """Why the jtop service cannot run here, or None."""
    if os.geteuid() != 0:
        return "jtop's service needs root (it runs in private mount and PID namespaces)"
    for tool in ("unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (util-linux)"
    if importlib.util.find_spec("jtop") is None:
        return "jetson-stats is not installed: pip install 'jetson-stats>=4.2'"
    try:
        base = overlay_base(jtop_config_dir())
    except Exception as e:  # an API change in jetson-stats
        return f"cannot find jtop's config folder ({e.__class__.__name__}: {e})"
    if base == Path("/"):
        return "jtop's config folder would need an overlay over /"
    return None


def free_gid() -> int:
    used = {g.gr_gid for g in grp.getgrall()}
    return next(gid for gid in range(61000, 65000) if gid not in used)


# --- the namespace --------------------------------------------------------------------------------


@dataclass
class JtopNamespace:
    work: Path
    init_pid: int = 0
    _proc: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.work / "jtop.log"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def root_path(self, path: str) -> Path:
        """A path inside the namespace's mounts, reachable from the host through /proc."""
        return Path(f"/proc/{self.init_pid}/root") / path.lstrip("/")

    def start(self, timeout: float = START_TIMEOUT) -> None:
        dmi = self.work / "dmi"
        dmi.mkdir()
        for name, value in FAKE_DMI.items():
            (dmi / name).write_text(value + "\n")
        try:
            grp.getgrnam("jtop")
            gid = ""  # the machine has one already (a Jetson): the copy of /etc keeps it
        except KeyError:
            gid = str(free_gid())
        env = {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "LANG": "C",
            "JTOP_GID": gid,
            "DMI_SRC": str(dmi),
            "CONFIG_BASE": str(overlay_base(jtop_config_dir())),
            "READY_MARK": READY_MARK,
        }
        cmd = [
            "unshare",
            "--fork",
            "--kill-child",
            "--pid",
            "--mount",
            "--mount-proc",
            "--propagation",
            "private",
            "sh",
            "-c",
            SETUP,
            "sh",
            *jtop_command(),
        ]
        with self.log_path.open("wb") as out:
            self._proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.init_pid = wait_until(self._find_init, timeout, "the namespace's PID 1")
        wait_until(self._socket_answers, timeout, f"jtop's service to listen on {JTOP_SOCKET}")

    def _exited(self) -> None:
        """Raise, saying why, when the namespace ended before the service came up."""
        if self._proc is None or self._proc.poll() is None:
            return
        log = self.log()
        if READY_MARK not in log:
            raise SetupError(f"the namespace could not be set up (exit {self._proc.returncode}):\n{log[-3000:]}")
        raise AssertionError(f"jtop's service exited ({self._proc.returncode}):\n{log[-3000:]}")

    def _find_init(self) -> int | None:
        self._exited()
        assert self._proc is not None
        kids = children_of(self._proc.pid)
        return kids[0] if kids else None

    def _socket_answers(self) -> bool:
        """The socket exists and accepts a connection (bound and listening, not just bound)."""
        self._exited()
        path = self.root_path(JTOP_SOCKET)
        if not path.exists():
            return False
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            try:
                sock.connect(str(path))
            except (ConnectionRefusedError, FileNotFoundError):
                return False
        return True

    def run(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """Run a command in the namespace (its mounts and PIDs), from the repository, with a clean
        environment: the test runner's variables stay out."""
        cmd = ["nsenter", "-t", str(self.init_pid), "-m", "-p", f"--wd={REPO}", *argv]
        env = {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "LANG": "C",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)

    def stop(self) -> None:
        """SIGTERM to the service (the namespace's PID 1), SIGKILL if it outstays the deadline."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None and self.init_pid:
            os.kill(self.init_pid, signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                os.kill(self.init_pid, signal.SIGKILL)  # PID 1 of the namespace: takes all with it
                try:
                    proc.wait(timeout=STOP_TIMEOUT)
                except subprocess.TimeoutExpired:
                    pass
        if proc.poll() is None:
            proc.kill()  # unshare --kill-child: its child, the namespace's PID 1, dies with it
            proc.wait(timeout=STOP_TIMEOUT)
        self._proc = None
