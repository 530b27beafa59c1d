"""The gRPC keys of [server]: safe defaults, paths, and refusals that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from edged.config import ConfigError, from_mapping
from edged.transports.grpc.server import GrpcServer, grpc_socket_path


def test_defaults() -> None:
    cfg = from_mapping({"server": {"socket": "/run/x/edged.sock"}}, "edged.toml", Path("/etc/edged"))
    s = cfg.server
    assert grpc_socket_path(cfg) == "/run/x/edged.sock.grpc"
    assert s.grpc_tcp == [] and s.grpc_max_streams == 256 and s.grpc_stream_requests == 100_000
    assert s.grpc_write_timeout_s == 10.0


def test_socket_path_relative_and_off() -> None:
    cfg = from_mapping({"server": {"grpc_socket": "g.sock"}}, "edged.toml", Path("/etc/edged"))
    assert grpc_socket_path(cfg) == "/etc/edged/g.sock"
    off = from_mapping({"server": {"grpc_socket": "none"}}, "edged.toml", Path("/etc/edged"))
    assert grpc_socket_path(off) is None


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"grpc_max_streams": 0}, "server.grpc_max_streams: Expected `int` >= 1"),
        ({"grpc_stream_requests": 0}, "server.grpc_stream_requests: Expected `int` >= 1"),
        ({"grpc_write_timeout_s": 0}, "server.grpc_write_timeout_s: Expected `float` > 0"),
        ({"grpc_tcp": "127.0.0.1:1"}, "server.grpc_tcp: Expected `array`"),
    ],
)
def test_bad_values_name_the_key(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_mapping({"server": raw}, "edged.toml", Path("/etc/edged"))
    assert message in info.value.message


def test_an_exposed_address_needs_the_token() -> None:
    cfg = from_mapping({"server": {"grpc_tcp": ["0.0.0.0:8001"]}}, "edged.toml", Path("/etc/edged"))
    with pytest.raises(ConfigError, match="server.grpc_tcp: 0.0.0.0:8001 is not a loopback address"):
        GrpcServer(None, None, cfg, None)  # type: ignore[arg-type]
    bad = from_mapping({"server": {"grpc_tcp": ["nope"]}}, "edged.toml", Path("/etc/edged"))
    with pytest.raises(ConfigError, match="server.grpc_tcp: expected host:port"):
        GrpcServer(None, None, bad, None)  # type: ignore[arg-type]
