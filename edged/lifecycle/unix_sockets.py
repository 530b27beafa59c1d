"""Binding the daemon's Unix sockets (the API, gRPC, the descriptor socket).

A socket file left by a crashed run is replaced; one that a live daemon still serves on is never
taken over. The file never exists with looser permissions than the configured mode, and it gets
the configured group before anybody can connect.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

from edged.errors import ConfigError, SocketInUseError

# Binding is a step of the daemon's start-up: its lines carry the daemon's logger name, which is
# what operators read and filter the start-up by.
log = logging.getLogger("edged.lifecycle.daemon")


def bind_socket(path: str, mode: int, group: str = "", kind: int = socket.SOCK_STREAM) -> socket.socket:
    """Bind a Unix socket: replace a stale file from a crashed run, never steal a live one."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.exists() or p.is_symlink():
        probe_sock = socket.socket(socket.AF_UNIX, kind)
        try:
            probe_sock.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            log.info("removing stale socket %s", path)
            p.unlink(missing_ok=True)
        except OSError as e:
            raise SocketInUseError(f"{path} exists and is not a usable socket: {e}") from None
        else:
            raise SocketInUseError(f"another edged is already serving on {path}; refusing to start")
        finally:
            probe_sock.close()
    sock = socket.socket(socket.AF_UNIX, kind)
    old = os.umask(0o777 & ~mode)  # the file is never visible with looser permissions
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, mode)
    if group:
        import grp

        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            sock.close()
            p.unlink(missing_ok=True)
            raise ConfigError(f"server.socket_group: there is no group named {group!r}") from None
        os.chown(path, -1, gid)
    sock.listen(256)
    sock.setblocking(False)
    return sock
