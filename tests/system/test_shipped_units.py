"""The units in systemd/ as shipped, under a real systemd 252, with a stand-in daemon.

Only ExecStart= is replaced (a drop-in runs standin_daemon.py); the user, groups, directories,
socket, device policy and every hardening line are the real ones. The users come from
systemd/edged.sysusers and /run/edged from systemd/edged.tmpfiles, applied with the real
systemd-sysusers and systemd-tmpfiles to a private copy of /etc.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

import pytest
from ns_host import REPO
from ns_waits import open_fifo_writer
from systemd_ns import Boot, BootOptions, SystemdNamespace
from unit_python import python_for_units

UNITS = REPO / "systemd"
SOCKET = "/run/edged/edged.sock"
# In the namespace's /run: the service's /tmp is private (PrivateTmp=yes), so not in tmp_path.
RELOAD_FIFO = "/run/edged-test/reload"


def standin_drop_in() -> str:
    python, pythonpath = python_for_units()
    return f"""[Service]
ExecStart=
ExecStart={python} {REPO}/tests/system/standin_daemon.py
Environment=PYTHONPATH={pythonpath} STANDIN_RELOAD_FIFO={RELOAD_FIFO}
# The checkout may live where the hardened unit hides things (CI can clone it under /tmp, which
# PrivateTmp= replaces): make it visible, read-only, as an installed venv would be.
BindReadOnlyPaths={REPO}
"""


@pytest.fixture
def shipped(boot_systemd: Boot) -> SystemdNamespace:
    """A namespace with edged.socket and edged.service installed as install.sh would."""
    units = {
        "edged.service": (UNITS / "edged.service").read_text(),
        "edged.socket": (UNITS / "edged.socket").read_text(),
        "edged.service.d/stand-in.conf": standin_drop_in(),
    }
    options = BootOptions(private_etc=True, wants=(), tmpfs=("/tmp", "/var/tmp", "/var/lib", "/var/cache"))
    ns = boot_systemd(units, options)
    ns.run("systemd-sysusers", str(UNITS / "edged.sysusers"), check=True)
    ns.run("systemd-tmpfiles", "--create", str(UNITS / "edged.tmpfiles"), check=True)
    ns.daemon_reload()  # User=edged resolves against the users just created
    fifo = ns.root_path(RELOAD_FIFO)
    fifo.parent.mkdir(mode=0o755)
    os.mkfifo(fifo)
    fifo.chmod(0o666)  # the stand-in runs as edged
    return ns


def group_id(ns: SystemdNamespace, name: str) -> int:
    for line in ns.root_path("/etc/group").read_text().splitlines():
        fields = line.split(":")
        if fields[0] == name:
            return int(fields[2])
    raise AssertionError(f"group {name} missing from the namespace's /etc/group")


def ask(ns: SystemdNamespace) -> dict[str, Any]:
    with ns.connect(SOCKET, timeout=30) as sock:
        data = b"".join(iter(lambda: sock.recv(65536), b""))
    return dict(json.loads(data))


@pytest.mark.system
def test_socket_activation_starts_the_hardened_service(shipped: SystemdNamespace) -> None:
    ns = shipped
    ns.systemctl("start", "edged.socket", check=True)
    for path in (SOCKET, SOCKET + ".fd"):  # the API and the descriptor socket (memfd regions)
        sock = ns.root_path(path).lstat()
        assert stat.S_ISSOCK(sock.st_mode), path
        assert stat.S_IMODE(sock.st_mode) == 0o660, path
        assert sock.st_gid == group_id(ns, "edged"), path
    rundir = ns.root_path("/run/edged").stat()
    assert stat.S_IMODE(rundir.st_mode) == 0o750 and rundir.st_gid == group_id(ns, "edged")
    assert ns.state("edged.service") == "inactive"

    got = ask(ns)  # the connection waits in the backlog while systemd starts the service
    ns.wait_state("edged.service", "active")
    assert got["fds"] == [3, 4]
    assert got["env"]["LISTEN_FDS"] is None  # consumed, so a build child never inherits it
    assert got["watchdog"] == 20.0
    assert got["uid"] != 0 and got["gid"] == group_id(ns, "edged")
    for name in ("video", "render", "jtop"):
        assert group_id(ns, name) in got["groups"], name
    assert got["env"]["EDGED_CONFIG"] == "/etc/edged/edged.toml"
    assert ns.show("edged.service", "StatusText")["StatusText"] == "stand-in ready"


@pytest.mark.system
def test_sandbox_is_what_the_unit_promises(shipped: SystemdNamespace) -> None:
    ns = shipped
    ns.systemctl("start", "edged.socket", "edged.service", check=True)
    got = ask(ns)
    # Writable: only RuntimeDirectory=, StateDirectory=, CacheDirectory= and a private /tmp.
    assert got["write"] == {
        "/etc": "EROFS",
        "/usr": "EROFS",
        "/opt": "EROFS",
        "/var/lib/edged": "ok",
        "/var/cache/edged": "ok",
        "/run/edged": "ok",
        "/tmp": "ok",
    }
    assert got["home"] in ("EACCES", "ENOENT")  # ProtectHome=yes
    assert got["netlink"] == "EAFNOSUPPORT"  # RestrictAddressFamilies=
    assert got["inet6"] == "ok"  # MQTT
    assert got["dev_null"] == "ok"
    assert got["dev_closed"] == "EPERM"  # DevicePolicy=closed: not a GPU node
    assert int(got["cap_eff"], 16) == 0
    assert got["no_new_privs"] == "1"
    assert got["seccomp"] == "2"  # SystemCallFilter= is a filter
    assert got["umask"] == "0077"
    for path in ("/var/lib/edged", "/var/cache/edged"):
        st = ns.root_path(path).stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (got["uid"], 0o750), path


@pytest.mark.system
def test_reload_and_stop_keep_the_socket(shipped: SystemdNamespace) -> None:
    ns = shipped
    ns.systemctl("start", "edged.socket", "edged.service", check=True)
    ns.wait_state("edged.service", "active")

    # ExecReload= sends SIGHUP; RELOADING=1 holds the unit in "reloading" until READY=1.
    ns.systemctl("reload", "--no-block", "edged.service", check=True)
    ns.wait_state("edged.service", "reloading")
    go = open_fifo_writer(ns.root_path(RELOAD_FIFO))
    os.write(go, b"go")
    os.close(go)
    ns.wait_state("edged.service", "active")
    ns.wait_property("edged.service", "StatusText", "stand-in reloaded 1")
    assert ns.show("edged.service", "NRestarts")["NRestarts"] == "0"

    # Stopping the service must leave /run/edged/edged.sock (RuntimeDirectoryPreserve=yes), so
    # the next client starts it again.
    ns.systemctl("stop", "edged.service", check=True)
    assert ns.show("edged.service", "Result")["Result"] == "success"
    assert ns.root_path(SOCKET).exists()
    assert ns.state("edged.socket") == "active"
    assert ask(ns)["fds"] == [3, 4]
    ns.wait_state("edged.service", "active")
