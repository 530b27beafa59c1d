"""The gRPC listeners: grpcio's asyncio server on the daemon's loop, behind the Unix relay
(peers.py) and on the ``[server] grpc_tcp`` addresses, with edged's bounds.

- ``grpc.max_receive_message_length`` = ``server.max_body``: a larger message is refused by
  grpcio before it is parsed (RESOURCE_EXHAUSTED);
- ``maximum_concurrent_rpcs`` = ``server.grpc_max_streams``: RPCs beyond it are refused at once
  (RESOURCE_EXHAUSTED), and so is each connection's HTTP/2 stream count;
- ``grpc.so_reuseport`` off: a second daemon cannot share a TCP port silently.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from edged.config import Config, parse_size
from edged.errors import ConfigError
from edged.serving.service import Service
from edged.transports.grpc.access import Access
from edged.transports.grpc.control import Control
from edged.transports.grpc.infer import Inference, guarded
from edged.transports.grpc.peers import UnixRelay
from edged.transports.peer import is_loopback, parse_address, read_token
from edged.transports.shm.regions import SharedMemoryRegistry
from edged.wire.proto import grpc_service_pb2_grpc as pbg

log = logging.getLogger(__name__)

_CONTROL = [name for name in dir(pbg.GRPCInferenceServiceServicer) if not name.startswith("_") and name[0].isupper()]
_STREAMS = {"ModelStreamInfer"}


def grpc_socket_path(cfg: Config) -> str | None:
    """The gRPC Unix socket: ``server.grpc_socket``, by default the HTTP socket's path + ".grpc"."""
    path = cfg.server.grpc_socket
    if path == "none":
        return None
    return path or cfg.server.socket + ".grpc"


class GrpcServer:
    def __init__(self, service: Service, regions: SharedMemoryRegistry, cfg: Config, admin_gid: int | None) -> None:
        s = cfg.server
        token = read_token(s.tcp_token_file) if s.tcp_token_file else None
        self.relay: UnixRelay | None = None
        self.tcp = [_checked_address(addr, token) for addr in s.grpc_tcp]
        self._peer_of: Callable[[str], Any] = lambda name: None
        self.access = Access(token, lambda name: self._peer_of(name), admin_gid)
        self.control = Control(service, regions, self.access)
        self.inference = Inference(service, regions, self.access, s.grpc_stream_requests, s.grpc_write_timeout_s)
        max_body = parse_size(s.max_body)
        options = [
            ("grpc.max_receive_message_length", max_body),
            ("grpc.max_send_message_length", -1),
            ("grpc.max_concurrent_streams", s.grpc_max_streams),
            ("grpc.so_reuseport", 0),
        ]
        self.server = grpc.aio.server(options=options, maximum_concurrent_rpcs=s.grpc_max_streams)
        pbg.add_GRPCInferenceServiceServicer_to_server(_servicer(self.control, self.inference), self.server)
        self.ports: list[int] = []

    async def start(self, unix: socket.socket | None, loop: Any) -> None:
        if unix is not None:
            s = self.control.service.registry.cfg.server
            self.relay = UnixRelay(unix, s.max_connections)
            self._peer_of = self.relay.peer
            self.server.add_insecure_port("unix:" + self.relay.inner)
        for text, (host, port) in self.tcp:
            bound = _add_port(self.server, host, port, text)
            self.ports.append(bound)
        await self.server.start()
        if self.relay is not None:
            self.relay.start(loop)

    def stop_accepting(self) -> None:
        self.inference.accepting = False

    async def stop(self, grace_s: float) -> None:
        if self.relay is not None:
            self.relay.sock.close()  # no new connections while the calls in flight finish
        await self.server.stop(grace_s)
        if self.relay is not None:
            self.relay.close()


def _checked_address(text: str, token: bytes | None) -> tuple[str, tuple[str, int]]:
    host, port = parse_address(text, "grpc_tcp")
    if not is_loopback(host) and token is None:
        raise ConfigError(
            f"server.grpc_tcp: {text} is not a loopback address; set server.tcp_token_file so that "
            "calls must carry a bearer token"
        )
    return text, (host, port)


def _add_port(server: grpc.aio.Server, host: str, port: int, text: str) -> int:
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(target)
    except RuntimeError as e:
        raise ConfigError(f"server.grpc_tcp: cannot listen on {text}: {e}") from None
    if not bound:
        raise ConfigError(f"server.grpc_tcp: cannot listen on {text}")
    return bound


def _servicer(control: Control, inference: Inference) -> pbg.GRPCInferenceServiceServicer:
    """The generated servicer with every RPC answered by control.py or infer.py, each behind the
    listener's access check and with every exception turned into its gRPC status."""
    methods: dict[str, Callable[..., Awaitable[Any]]] = {}
    for name in _CONTROL:
        impl = getattr(inference, name, None) or getattr(control, name)
        methods[name] = _wrapped(impl, name, control.access)
    return type("Servicer", (pbg.GRPCInferenceServiceServicer,), methods)()  # type: ignore[no-any-return]


def _wrapped(impl: Callable[..., Awaitable[Any]], name: str, access: Access) -> Callable[..., Awaitable[Any]]:
    async def rpc(self: object, request: Any, context: Any) -> Any:
        async def checked() -> Any:
            access.check(context)
            return await impl(request, context)

        return await guarded(checked(), context, name)

    rpc.__name__ = name
    return rpc
