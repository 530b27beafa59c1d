"""The gRPC listeners: grpcio's asyncio server on the daemon's loop, behind the relay
(peers.py) that accepts on the Unix socket and the ``[server] grpc_tcp`` addresses, with
edged's bounds.

- ``grpc.max_receive_message_length`` = ``server.max_body`` + ``server.max_json``: a larger
  message is refused by grpcio before it is parsed (RESOURCE_EXHAUSTED); one between the two is
  refused by infer.py with edged's code, as HTTP refuses a body over ``server.max_body``;
- ``server.grpc_max_streams`` calls at once (_Slots; a unary call until its handler returns, a
  stream until it ends): one more is refused at once with RESOURCE_EXHAUSTED (``stream_limit``).
  grpcio's own ``maximum_concurrent_rpcs`` is not used: it counts a unary call until its answer
  is delivered, so peers that take no data held every slot, and on a loaded machine it stopped
  taking new calls at the limit, which then waited out their deadlines instead of being refused.
  A unary answer grpcio cannot deliver within ``server.grpc_write_timeout_s`` has its connection
  cut (``Inference.watch``, through the relay). Each connection's HTTP/2 stream count is held to
  the same number through SETTINGS_MAX_CONCURRENT_STREAMS, so a client past it on one connection
  waits for a stream of its own connection to end (HTTP/2's rule, kept by the client);
- the relay holds the connections to ``server.max_connections`` and each peer to its share,
  and their messages under way to ``server.bodies_in_flight`` (peers.py); grpcio's own socket,
  which only the relay reaches, takes ``server.max_connections`` + _CLOSING_SLACK (a connection
  the relay has just closed may still count in grpcio for a moment);
- the TCP sockets are edged's, bound without SO_REUSEPORT: a second daemon cannot share a port.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from edged.config import Config, parse_size
from edged.errors import ConfigError, StreamLimitError
from edged.serving.service import Service
from edged.transports.budget import BodyBudget
from edged.transports.grpc.access import Access
from edged.transports.grpc.control import Control
from edged.transports.grpc.infer import Inference
from edged.transports.grpc.peers import Relay
from edged.transports.grpc.status import abort
from edged.transports.peer import Peer, is_loopback, parse_address, read_token, tcp_socket
from edged.transports.shm.regions import SharedMemoryRegistry
from edged.wire.proto import grpc_service_pb2 as pb

log = logging.getLogger(__name__)

_SERVICE = "inference.GRPCInferenceService"
# Connections beyond server.max_connections that a listener takes (see above).
_CLOSING_SLACK = 16
_INFER = {"ModelInfer", "ModelStreamInfer"}
_RAW_CONTROL = {"RepositoryModelLoad"}


def grpc_socket_path(cfg: Config) -> str | None:
    """The gRPC Unix socket: ``server.grpc_socket``, by default the HTTP socket's path + ".grpc"."""
    path = cfg.server.grpc_socket
    if path == "none":
        return None
    return path or cfg.server.socket + ".grpc"


class GrpcServer:
    def __init__(
        self,
        service: Service,
        regions: SharedMemoryRegistry,
        cfg: Config,
        admin_gid: int | None,
        bodies: BodyBudget | None = None,
    ) -> None:
        s = cfg.server
        self.bodies = bodies if bodies is not None else BodyBudget(parse_size(s.bodies_in_flight))
        token = read_token(s.tcp_token_file) if s.tcp_token_file else None
        self.tcp = [_checked_address(addr, token) for addr in s.grpc_tcp]
        closed = service.metrics.grpc_closed
        self.relay = Relay(
            s.max_connections,
            s.max_connections_per_peer,
            self.bodies,
            s.read_timeout_s,
            lambda reason: closed.labels(reason).inc(),
        )
        self.access = Access(token, self._peer_of, admin_gid, self.relay.called)
        self.control = Control(service, regions, self.access)
        max_body = parse_size(s.max_body)
        self.inference = Inference(
            service, regions, self.access, s.grpc_stream_requests, s.grpc_write_timeout_s, max_body
        )
        self.inference.cut = self.relay.cut_stalled
        self.inference.label = self.relay.label
        options = [
            ("grpc.max_receive_message_length", max_body + parse_size(s.max_json)),
            ("grpc.max_send_message_length", -1),
            ("grpc.max_concurrent_streams", s.grpc_max_streams),
            ("grpc.max_allowed_incoming_connections", s.max_connections + _CLOSING_SLACK),
        ]
        self.server = grpc.aio.server(options=options)
        _register(self.server, self.control, self.inference, _Slots(s.grpc_max_streams))
        self.ports: list[int] = []

    def _peer_of(self, name: str) -> Peer | None:
        client = self.relay.client(name)
        return client.peer if client is not None else None

    async def start(self, unix: socket.socket | None, loop: Any) -> None:
        try:
            if unix is not None:
                self.relay.listen(unix)
            for text, (host, port) in self.tcp:
                sock = tcp_socket(host, port, text, "grpc_tcp")
                self.relay.listen(sock)
                self.ports.append(sock.getsockname()[1])
            if not self.server.add_insecure_port("unix:" + self.relay.inner):
                raise ConfigError(f"gRPC: cannot listen on {self.relay.inner}")
            await self.server.start()
        except BaseException:
            self.relay.close()
            raise
        self.relay.start(loop)

    def stop_accepting(self) -> None:
        self.inference.accepting = False

    async def stop(self, grace_s: float) -> None:
        self.relay.stop_listening()  # no new connections while the calls in flight finish
        await self.server.stop(grace_s)
        self.relay.close()


def _checked_address(text: str, token: bytes | None) -> tuple[str, tuple[str, int]]:
    host, port = parse_address(text, "grpc_tcp")
    if not is_loopback(host) and token is None:
        raise ConfigError(
            f"server.grpc_tcp: {text} is not a loopback address; set server.tcp_token_file so that "
            "calls must carry a bearer token"
        )
    return text, (host, port)


def _register(server: grpc.aio.Server, control: Control, inference: Inference, slots: _Slots) -> None:
    """Every RPC of the service answered by control.py or infer.py, behind the listener's access
    check, with every exception turned into its gRPC status. The inference RPCs take their
    messages as bytes (infer.py parses them: grpcio's own refusals of a message it cannot parse
    carry neither edged's code nor HTTP's words) and answer with bytes.

    grpcio writes a unary handler's answer itself, after the handler returns, and holds the call
    for as long as the peer takes no data. So a unary call holds its slot of grpc_max_streams
    until its handler returns, and from then on ``Inference.watch`` bounds the answer's delivery
    by the streams' write time-out. A unary RPC served as a stream of one message would have
    that time-out from ``context.write`` too, but it costs a second batch of grpcio operations,
    and a second wake-up of the loop, on every call (0.06-0.10 ms of a 0.7 ms call here)."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
        name = method.name
        raw = name in _INFER
        impl = getattr(inference, name) if raw else getattr(control, name)
        # Messages that may be large reach their handler as bytes, parsed after its checks (and
        # off the loop): inference requests, and a load that brings a model's files.
        request = None if raw or name in _RAW_CONTROL else getattr(pb, method.input_type.name).FromString
        access = None if raw else control.access
        if method.client_streaming:
            kind, handler = grpc.stream_stream_rpc_method_handler, slots.held(impl, name, access)
        else:
            kind, handler = grpc.unary_unary_rpc_method_handler, slots.held(impl, name, access, inference.watch)
        handlers[name] = kind(
            handler,
            request_deserializer=request,
            # The inference RPCs answer with bytes they serialized (off the loop when large).
            response_serializer=None if raw else getattr(pb, method.output_type.name).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, handlers),))
    server.add_registered_method_handlers(_SERVICE, handlers)


class _Slots:
    """At most ``limit`` calls at once, each counted from its handler's start to its return."""

    def __init__(self, limit: int) -> None:
        self.limit, self.active = limit, 0

    def held(
        self,
        impl: Callable[..., Awaitable[Any]],
        name: str,
        access: Access | None,
        then: Callable[[Any], None] | None = None,
    ) -> Callable[..., Awaitable[Any]]:
        """The RPC ``name`` answered by ``impl`` within the limit, with the access check
        (infer.py's RPCs check for themselves: they keep the peer) and every exception caught:
        the cancellation and grpcio's own abort pass, the rest end the RPC with their status
        (abort raises); ``then(context)`` once it has returned an answer. One coroutine per call:
        on the way of every inference request."""

        async def call(request: Any, context: Any) -> Any:
            if self.active >= self.limit:
                full = StreamLimitError(
                    f"{self.active} gRPC calls are in progress, the most at once (server.grpc_max_streams): "
                    "retry when one has ended"
                )
                await abort(context, full, name)
            self.active += 1
            try:
                if access is not None:
                    access.check(context)
                answer = await impl(request, context)
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except BaseException as e:
                await abort(context, e, name)
            finally:
                self.active -= 1
            if then is not None:
                then(context)
            return answer

        call.__name__ = name
        return call
