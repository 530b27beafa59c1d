"""The listening sockets: which ones, what each lets through, and uvicorn serving all of them.

- the Unix socket (the config's, or every socket systemd passes by socket activation: told apart
  by FileDescriptorName, "metrics" serving only metrics and health, any other name the API);
- ``[server] tcp``: TCP listeners for the same API (tritonclient.http and other tools speak only
  host:port). One on an address that is not loopback is refused unless ``tcp_token_file`` gives
  a token; once it is set, every request on every TCP listener, loopback included, must carry it
  (``Authorization: Bearer``, compared in constant time);
- ``[server] metrics``: a TCP listener that serves only ``/metrics`` and ``/v2/health/*`` (the
  token too, when set).

All listeners share one uvicorn Server (so one drain stops them all) and one set of connection
slots (slots.py); each connection gets the bounds of connection.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import uvicorn

from edged.config import Config
from edged.errors import ConfigError
from edged.host import systemd
from edged.paths import fd_socket_for
from edged.transports.http.connection import EdgedProtocol, check_uvicorn
from edged.transports.http.slots import ConnectionLimits, ConnectionSlots
from edged.transports.peer import ListenerAccess, parse_address, read_token, tcp_socket
from edged.transports.peer import is_loopback as is_loopback

log = logging.getLogger(__name__)

METRICS_NAME = "metrics"  # FileDescriptorName of an activated metrics-only socket


@dataclass
class Listener:
    """One listening socket and what it serves; ``owned_path`` is a Unix socket file this process
    created (removed at stop)."""

    sock: socket.socket
    access: ListenerAccess
    owned_path: str | None = None
    memfd: bool = False  # the descriptor socket (memfd_socket.py), not served by uvicorn


def _tcp(text: str, key: str, token: bytes | None, metrics_only: bool) -> Listener:
    host, port = parse_address(text, key)
    exposed = not is_loopback(host)
    if exposed and token is None:
        raise ConfigError(
            f"server.{key}: {text} is not a loopback address; set server.tcp_token_file so that "
            "requests must carry a bearer token"
        )
    sock = tcp_socket(host, port, text, key)
    what = "metrics and health only" if metrics_only else "the API"
    # Once a token file is set it guards every TCP listener, loopback included: any local user can
    # connect to 127.0.0.1, also one outside the Unix socket's group.
    auth = ", bearer token required" if token is not None else ""
    return Listener(sock, ListenerAccess(f"tcp {text} ({what}{auth})", metrics_only, token))


def _activated(fds: list[int], names: list[str], token: bytes | None, memfd: bool) -> list[Listener]:
    out: list[Listener] = []
    for i, fd in enumerate(fds):
        name = names[i] if i < len(names) else ""
        sock = socket.socket(fileno=fd)
        if sock.family == socket.AF_UNIX and sock.type == socket.SOCK_SEQPACKET and not any(x.memfd for x in out):
            # ListenSequentialPacket= in edged.socket: the descriptor socket (one unit names all
            # its sockets alike, so the type tells it apart).
            if not memfd:
                log.info("activated descriptor socket (fd %d) closed: server.memfd_socket is false", fd)
                sock.close()
                continue
            sock.setblocking(False)
            out.append(Listener(sock, ListenerAccess(f"activated descriptor socket (fd {fd})"), memfd=True))
            continue
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6):
            log.warning("socket activation passed fd %d (%s), not a stream socket edged can serve: closed", fd, name)
            sock.close()
            continue
        sock.setblocking(False)
        metrics_only = name == METRICS_NAME
        exposed = sock.family != socket.AF_UNIX and not is_loopback(str(sock.getsockname()[0]))
        if exposed and token is None:
            log.warning("activated socket '%s' (fd %d) is not loopback and no tcp_token_file is set: closed", name, fd)
            sock.close()
            continue
        if name not in ("", METRICS_NAME, "http", "edged", "api", "tcp"):
            log.warning("activated socket '%s' (fd %d) has an unexpected FileDescriptorName; serving the API", name, fd)
        what = "metrics and health only" if metrics_only else "the API"
        out.append(
            Listener(
                sock,
                ListenerAccess(
                    f"activated socket '{name}' (fd {fd}, {what})",
                    metrics_only,
                    token if sock.family != socket.AF_UNIX else None,
                ),
            )
        )
    return out


def listeners_from(cfg: Config, bind_unix: Callable[[str, int, str, int], socket.socket]) -> list[Listener]:
    """Every listener the config and socket activation ask for; ConfigError for a bad one."""
    s = cfg.server
    token = read_token(s.tcp_token_file) if s.tcp_token_file else None
    # Read before systemd.listen_fds(), which removes LISTEN_* from the environment.
    names = os.environ.get("LISTEN_FDNAMES", "").split(":")
    fds = systemd.listen_fds()
    out: list[Listener] = []
    try:
        if fds:
            out += _activated(fds, names, token, s.memfd_socket)
        else:
            path, mode = s.socket, int(s.socket_mode, 8)
            out.append(Listener(bind_unix(path, mode, s.socket_group, socket.SOCK_STREAM), ListenerAccess(path), path))
            if s.memfd_socket:
                fds_path = fd_socket_for(path)
                sock = bind_unix(fds_path, mode, s.socket_group, socket.SOCK_SEQPACKET)
                out.append(Listener(sock, ListenerAccess(fds_path), fds_path, memfd=True))
        out += [_tcp(addr, "tcp", token, False) for addr in s.tcp]
        if s.metrics:
            out.append(_tcp(s.metrics, "metrics", token, True))
    except BaseException:
        for listener in out:
            listener.sock.close()
        raise
    return out


async def start(app: Any, cfg: Config, listeners: list[Listener]) -> uvicorn.Server:
    """Serve ``app`` on every listener; the returned Server's shutdown() drains and closes all."""
    check_uvicorn()
    config = uvicorn.Config(
        app,
        http="httptools",
        loop="none",
        lifespan="off",
        access_log=False,
        log_config=None,
        server_header=False,
        date_header=False,
        interface="asgi3",
        proxy_headers=False,
        timeout_keep_alive=cfg.server.keepalive_s,
    )
    # Set after construction: uvicorn types it as int, and int() would turn 0.5 s into no drain.
    config.timeout_graceful_shutdown = cfg.lifecycle.drain_timeout_s  # type: ignore[assignment]
    config.load()
    # What Server.serve() would do, per listener; edged drives startup and shutdown itself so that
    # the lifecycle (and its signal handling) stays in one place.
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)
    slots = ConnectionSlots(ConnectionLimits.from_config(cfg))
    # The app's answers made at once on the connection (inline.Direct), where it has them.
    direct = app if hasattr(app, "wants") and hasattr(app, "now") else None
    loop = asyncio.get_running_loop()
    server.servers = []
    for listener in listeners:

        def protocol(access: ListenerAccess = listener.access) -> EdgedProtocol:
            state = server.server_state
            return EdgedProtocol(
                config=config, server_state=state, app_state={}, _loop=loop, slots=slots, access=access, direct=direct
            )

        server.servers.append(await loop.create_server(protocol, sock=listener.sock, backlog=config.backlog))
        log.info("serving on %s", listener.access.label)
    server.started = True
    return server
