"""Where the daemon's socket is: the one resolution the CLI and the Python client share.

Order: ``--socket``, then ``$EDGED_SOCKET``, then ``[server] socket`` in the config file, then the
default. The answer says where the path came from, so an error can tell the user which knob to
turn. This module imports nothing heavier than ``os``: the client uses it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_SOCKET = "/run/edged/edged.sock"
ENV = "EDGED_SOCKET"


@dataclass(frozen=True)
class SocketPath:
    path: str
    source: str  # e.g. "--socket", "$EDGED_SOCKET", "[server] socket in /etc/edged/edged.toml", "the default"

    def __str__(self) -> str:
        return self.path


# Returns (socket, where it came from) when a config file sets one; None when there is none.
ConfigLookup = Callable[[], "tuple[str, str] | None"]


def resolve_socket(flag: str | None = None, config: ConfigLookup | None = None) -> SocketPath:
    if flag:
        return SocketPath(str(flag), "--socket")
    env = os.environ.get(ENV)
    if env:
        return SocketPath(env, f"${ENV}")
    found = config() if config is not None else None
    if found is not None:
        return SocketPath(*found)
    return SocketPath(DEFAULT_SOCKET, "the default")


def fd_socket_for(api_socket: str) -> str:
    """The descriptor socket (sealed memfd regions) next to an API socket: where the daemon binds
    it and where clients look for it."""
    return api_socket + ".fd"


def default_socket(config_socket: str | None = None) -> str:
    """The socket a client uses when given none: ``$EDGED_SOCKET``, the config's, the default."""
    config = None if config_socket is None else (lambda: (config_socket, "the config"))
    return resolve_socket(None, config).path


def isolate_library_files(cache_dir: str) -> None:
    """ONNX Runtime writes a device id and an events database under $XDG_CACHE_HOME on import:
    keep those under edged's own cache directory instead of a home directory. Called before
    anything imports onnxruntime (the daemon, ``edged plan``, ``edged build``)."""
    os.environ["XDG_CACHE_HOME"] = os.path.join(cache_dir, ".lib")
