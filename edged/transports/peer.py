"""Who is on the other end of a connection: SO_PEERCRED, a pidfd, group membership on a Unix
socket; a TCP listener's address, whether it is loopback, and the bearer token that guards it.

The credentials are the ones the kernel recorded at connect() time; nothing the client sends can
change them. The pidfd pins the peer process itself (a pid alone can be reused after the process
exits), so the regions it registers are released when exactly that process exits.
"""

from __future__ import annotations

import contextlib
import grp
import hmac
import ipaddress
import logging
import os
import pwd
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edged.errors import ConfigError

log = logging.getLogger(__name__)

SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux 6.5+; older kernels answer ENOPROTOOPT
_CRED = struct.Struct("3i")
PEER_KEY = "edged.peer"  # where the protocol puts the Peer in the ASGI scope
ACCESS_KEY = "edged.access"  # ... and the ListenerAccess it came through


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int
    # Owned by the connection (closed when it closes); None where no pidfd could be had.
    pidfd: int | None = None


@dataclass(frozen=True)
class ListenerAccess:
    """What a listener lets through: the whole API or only metrics and health, and the bearer
    token its requests must carry (TCP listeners on a non-loopback address)."""

    label: str
    metrics_only: bool = False
    token: bytes | None = None


def token_matches(headers: list[tuple[bytes, bytes]], token: bytes | None) -> bool:
    """The request's ``Authorization: Bearer`` is ``token`` (compared in constant time); True
    where the listener needs none."""
    if token is None:
        return True
    given = next((v for k, v in headers if k == b"authorization"), b"")
    return hmac.compare_digest(given, b"Bearer " + token)


def health_or_metrics(path: str | bytes) -> bool:
    """A path a metrics-only listener (and a reserved connection slot) serves."""
    raw = path.encode("latin-1") if isinstance(path, str) else path
    raw = raw.split(b"?", 1)[0]
    return raw == b"/metrics" or raw.startswith(b"/v2/health/")


def peer_of(sock: Any) -> Peer | None:
    """The peer of a connected AF_UNIX socket (None for any other family)."""
    if sock is None or getattr(sock, "family", None) != socket.AF_UNIX:
        return None
    pid, uid, gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return Peer(pid, uid, gid, _pidfd(sock, pid))


def _pidfd(sock: Any, pid: int) -> int | None:
    try:
        # The kernel's own reference to the connecting process: no window for pid reuse.
        return int(sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD))
    except OSError:
        pass
    if pid <= 0 or not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:  # exited already, or pidfd_open refused by a seccomp filter
        return None


def close_peer(peer: Peer | None) -> None:
    if peer is not None and peer.pidfd is not None:
        with contextlib.suppress(OSError):
            os.close(peer.pidfd)


def in_group(peer: Peer, gid: int) -> bool:
    """Root, the peer's primary gid, or a supplementary group of the peer's user."""
    if peer.uid == 0 or peer.gid == gid:
        return True
    try:
        user = pwd.getpwuid(peer.uid)
        group = grp.getgrgid(gid)
    except KeyError:
        return False
    return user.pw_gid == gid or user.pw_name in group.gr_mem


# --- listener addresses and their token (HTTP's and gRPC's TCP listeners) ---


def parse_address(text: str, key: str) -> tuple[str, int]:
    """ "127.0.0.1:8000", "[::1]:8000", "localhost:8000" -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not host:
        raise ConfigError(f"server.{key}: expected host:port such as '127.0.0.1:8000', got {text!r}")
    return host.strip("[]"), int(port)


def tcp_socket(host: str, port: int, text: str, key: str) -> socket.socket:
    """A listening, non-blocking TCP socket on ``host``:``port`` (``text`` as configured under
    ``server.<key>``), or a ConfigError that says why not. No SO_REUSEPORT: a second daemon on the
    same port fails here rather than sharing its connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, backlog=256)
    except OSError as e:
        raise ConfigError(f"server.{key}: cannot listen on {text}: {e.strerror}") from None
    sock.setblocking(False)
    return sock


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name that resolves elsewhere: treat as exposed


def read_token(path: str) -> bytes:
    try:
        st = os.stat(path)
        token = Path(path).read_bytes().strip()
    except OSError as e:
        raise ConfigError(f"server.tcp_token_file: cannot read {path}: {e.strerror}") from None
    if len(token) < 16:
        raise ConfigError(f"server.tcp_token_file: {path} must hold a token of at least 16 characters")
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("server.tcp_token_file %s is readable by others than its owner; chmod 600 it", path)
    return token
