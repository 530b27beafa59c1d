"""The gRPC floor: a bare grpcio asyncio server of Triton's ``inference.GRPCInferenceService``
(the service tritonclient ships generated, ``tritonclient.grpc.service_pb2_grpc``) that parses each
``ModelInfer`` request and answers one fixed ``ModelInferResponse``, read from a file (the
benchmark writes edged's own answer to the same request there, so both answers have the same
size). No edged code: what any Python gRPC server pays before it runs a model.

With ``--relay``, the same server behind edged's own relay (edged.transports.grpc.peers, with
the daemon's default bounds, on uvloop as in the daemon), as edged's grpcio is: what a grpcio
server pays that must know its Unix peers and bound what grpcio buffers, before it does any work
of its own. Each call tells the relay of itself, as edged's access check does (the relay closes a
TCP connection that makes no authorised call).

With ``--run SPECS_FILE MODEL`` as well, each ``ModelInfer`` runs the model on the request's raw
input (ONNX Runtime, the session every benchmark server builds, on the event loop) before it
answers: the least a grpcio server behind the relay does for the model, the bound of edged's gRPC
target (edged adds only its decoding, checks, statistics and encoding to it).

    python -m bench.grpc_floor RESPONSE_FILE UNIX_PATH TCP_PORT [--relay] [--run SPECS_FILE MODEL]

Listens on ``unix:UNIX_PATH`` and ``127.0.0.1:TCP_PORT``; answers ``ServerReady`` for readiness;
stops on SIGTERM.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc


class Floor(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    def __init__(
        self, response: Any, called: Callable[[str], None] | None = None, run: Callable[[Any], None] | None = None
    ) -> None:
        self.response = response
        self.called = called
        self.run = run

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerReadyResponse(ready=True)

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        if self.called is not None:
            self.called(context.peer())
        if self.run is not None:
            self.run(request)
        return self.response


def model_run(specs_file: Path, name: str) -> Callable[[Any], None]:
    """The model run on a request's first raw input (its shape and type as the spec says)."""
    import numpy as np

    from bench.models import read_specs, session

    spec = read_specs(specs_file)[name]
    run = session(spec).run
    outputs = [spec.outputs[0]]
    for _ in range(20):  # warm before the server answers, as every bound lane is
        run(outputs, {spec.input: spec.sample()})

    def on_request(request: Any) -> None:
        x = np.frombuffer(request.raw_input_contents[0], np.float32).reshape(spec.shape)
        run(outputs, {spec.input: x})

    return on_request


async def serve(
    response_file: Path, unix_path: str, port: int, relayed: bool, run: Callable[[Any], None] | None = None
) -> None:
    response = service_pb2.ModelInferResponse.FromString(response_file.read_bytes())
    # The limits tritonclient sets on its side, so a frame-sized message passes either way.
    options = [("grpc.max_send_message_length", 2**31 - 1), ("grpc.max_receive_message_length", 2**31 - 1)]
    server = grpc.aio.server(options=options)
    relay = _relay(unix_path, port) if relayed else None
    floor = Floor(response, relay.called if relay is not None else None, run)
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(floor, server)
    if relay is not None:
        server.add_insecure_port("unix:" + relay.inner)
    else:
        server.add_insecure_port(f"unix:{unix_path}")
        server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    if relay is not None:
        relay.start(asyncio.get_running_loop())
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(grace=1)
    if relay is not None:
        relay.close()


def _relay(unix_path: str, port: int) -> Any:
    """edged's relay on both listeners, with the daemon's default bounds."""
    from edged.config.server import ServerConfig
    from edged.config.sizes import parse_size
    from edged.transports.budget import BodyBudget
    from edged.transports.grpc.peers import Relay
    from edged.transports.peer import tcp_socket

    s = ServerConfig()
    relay = Relay(
        s.max_connections, s.max_connections_per_peer, BodyBudget(parse_size(s.bodies_in_flight)), s.read_timeout_s
    )
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(unix_path)
    unix.listen(256)
    unix.setblocking(False)
    relay.listen(unix)
    relay.listen(tcp_socket("127.0.0.1", port, f"127.0.0.1:{port}", "grpc_tcp"))
    return relay


def main(argv: list[str]) -> int:
    relayed = "--relay" in argv[3:]
    run = None
    if "--run" in argv[3:]:
        at = argv.index("--run")
        run = model_run(Path(argv[at + 1]), argv[at + 2])
    if relayed:  # on the loop edged's relay runs on
        import uvloop

        uvloop.run(serve(Path(argv[0]), argv[1], int(argv[2]), relayed, run))
    else:
        asyncio.run(serve(Path(argv[0]), argv[1], int(argv[2]), relayed, run))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
