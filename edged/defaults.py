"""Defaults that light modules share: the client needs the socket path without the config loader
(msgspec) behind it."""

DEFAULT_SOCKET = "/run/edged/edged.sock"
