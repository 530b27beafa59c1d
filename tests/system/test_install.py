"""scripts/install.sh end to end, inside a booted systemd: install, upgrade, uninstall, purge.

Everything install.sh writes lands in the namespace: /etc is a private copy, /opt, /var/lib
and /var/cache are tmpfs mounts, and systemd searches /etc/systemd/system (the copy) for the
units it installs. pip downloads from the package index this machine is configured for, so the
first run takes minutes (later ones use pip's cache). It installs from a copy of the checkout,
so the build leaves nothing in the working tree.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest
from ns_host import REPO
from systemd_ns import Boot, BootOptions, SystemdNamespace

SOCKET = "/run/edged/edged.sock"
TOP_LEVEL_SKIP = {
    ".git",
    ".venv",
    "build",
    "dist",
    "data",
    "bench-results",
    ".mypy_cache",
    ".ruff_cache",
    ".pytest_cache",
}


def ignore(directory: str, names: list[str]) -> set[str]:
    """What a checkout holds but an install does not need (top-level build output, caches)."""
    skip = {n for n in names if n == "__pycache__" or n.endswith(".egg-info")}
    if Path(directory) == REPO:
        skip |= TOP_LEVEL_SKIP & set(names)
    return skip


PASS_ENV = ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY")


def pip_env() -> dict[str, str]:
    """pip's own settings (index, certificates, proxies) from this environment."""
    return {k: v for k, v in os.environ.items() if k.startswith("PIP_") or k in PASS_ENV}


def http_get(ns: SystemdNamespace, path: str) -> str:
    """The status line of a GET over the daemon's Unix socket (what curl --unix-socket does)."""
    with ns.connect(SOCKET, timeout=60) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: edged\r\nConnection: close\r\n\r\n".encode())
        data = b"".join(iter(lambda: sock.recv(65536), b""))
    return data.split(b"\r\n", 1)[0].decode()


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    assert (REPO / "pyproject.toml").exists(), f"{REPO} is not the edged checkout"
    copy = tmp_path / "edged-src"
    shutil.copytree(REPO, copy, ignore=ignore, symlinks=True)
    return copy


@pytest.mark.system
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_install_upgrade_uninstall(boot_systemd: Boot, checkout: Path) -> None:
    options = BootOptions(
        private_etc=True,
        wants=(),
        extra_unit_paths=("/etc/systemd/system",),
        tmpfs=("/tmp", "/var/tmp", "/opt", "/var/lib", "/var/cache"),
    )
    ns = boot_systemd({}, options)
    script = str(checkout / "scripts" / "install.sh")

    def install(*args: str) -> str:
        out = ns.run("bash", script, *args, check=True, timeout=900, env=pip_env())
        return out.stderr

    install()
    ns.wait_state("edged.service", "active", timeout=120)
    assert ns.state("edged.socket") == "active"
    assert http_get(ns, "/v2/health/live") == "HTTP/1.1 200 OK"
    # The shipped config's example model has no file yet: no boot model serves, so not ready (0
    # models ready is not ready).
    assert http_get(ns, "/v2/health/ready") == "HTTP/1.1 503 Service Unavailable"
    conf = ns.root_path("/etc/edged/edged.toml")
    st = conf.stat()
    assert stat.S_IMODE(st.st_mode) == 0o640 and st.st_uid == 0
    enabled = ns.systemctl("is-enabled", "edged.socket", "edged.service").stdout.split()
    assert enabled == ["enabled", "enabled"]
    # The apt hook: installed where apt reads it, and it recorded the versions installed now.
    if ns.root_path("/etc/apt/apt.conf.d").is_dir():
        assert "edged-apt-hook" in ns.root_path("/etc/apt/apt.conf.d/80edged").read_text()
        assert len(ns.root_path("/var/lib/edged/apt-versions").read_text().strip()) == 64
    pid_before = ns.show("edged.service", "MainPID")["MainPID"]

    # ExecReload= (SIGHUP): the same process re-reads its config and is active again.
    ns.systemctl("reload", "edged.service", check=True, timeout=120)
    ns.wait_state("edged.service", "active", timeout=120)
    assert ns.show("edged.service", "MainPID")["MainPID"] == pid_before

    # Again: the operator's config survives, the running daemon is restarted onto the new code.
    conf.write_text(conf.read_text() + "\n# operator was here\n")
    log = install()
    assert "keeping /etc/edged/edged.toml" in log
    assert conf.read_text().endswith("# operator was here\n")
    ns.wait_state("edged.service", "active", timeout=120)
    assert ns.show("edged.service", "MainPID")["MainPID"] != pid_before

    install("--uninstall")
    assert ns.state("edged.service") == "inactive"
    assert not ns.root_path("/opt/edged").exists()
    assert not ns.root_path("/etc/systemd/system/edged.service").exists()
    assert not ns.root_path("/etc/apt/apt.conf.d/80edged").exists()
    assert conf.exists()  # kept without --purge
    install("--uninstall", "--purge")
    assert not ns.root_path("/etc/edged").exists()
