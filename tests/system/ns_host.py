"""The host side of the system tests: where the checkout is, whether this machine can boot
systemd in a namespace at all (root, tools, systemd, a writable cgroup2), the cgroup a namespace
is put in and removed from, and finding a process's children from /proc.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from ns_waits import wait_until

REPO = Path(__file__).resolve().parents[2]
SYSTEMD = Path("/lib/systemd/systemd")


class BootError(RuntimeError):
    """systemd could not be started in the namespace; the message says why."""


# --- prerequisites ------------------------------------------------------------------------------


def own_cgroup2_dir() -> Path:
    """This process's cgroup in the cgroup2 hierarchy, as a directory of the host's mount."""
    own = next(
        line.split("::", 1)[1] for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::")
    )
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields, _, fs = line.partition(" - ")
        if fs.split()[0] != "cgroup2":
            continue
        root, mountpoint = fields.split()[3:5]
        if own == root or own.startswith(root.rstrip("/") + "/"):
            return Path(mountpoint) / own[len(root) :].lstrip("/")
    raise BootError("no cgroup2 hierarchy is mounted (systemd 252 needs one)")


def missing_prerequisite() -> str | None:
    """Why system tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "system tests boot systemd in private namespaces and need root"
    for tool in ("unshare", "nsenter", "systemctl", "journalctl"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (util-linux / systemd)"
    if not SYSTEMD.exists():
        return f"{SYSTEMD} is missing: systemd is not installed"
    try:
        probe = own_cgroup2_dir() / f"edged-probe-{uuid.uuid4().hex[:8]}"
        probe.mkdir()
        probe.rmdir()
    except (OSError, BootError) as e:
        return f"cannot create a cgroup2 cgroup for systemd ({e}): cgroup2 not writable"
    return None


def children_of(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:  # kernel without CONFIG_PROC_CHILDREN: scan
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(stat.parent.name))
        return found


def remove_cgroup(path: Path) -> None:
    """Remove the namespace's cgroup subtree once it is empty (leaf first)."""

    def empty() -> bool:
        events = path / "cgroup.events"
        return not events.exists() or "populated 0" in events.read_text()

    try:
        wait_until(empty, 30, f"{path} to empty")
    except TimeoutError:
        (path / "cgroup.kill").write_text("1")  # kernel 5.14+: the last resort
        wait_until(empty, 30, f"{path} to empty after cgroup.kill")
    for dirpath, _, _ in sorted(os.walk(path), key=lambda w: -w[0].count("/")):
        os.rmdir(dirpath)
