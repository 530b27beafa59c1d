"""The gRPC floor: a bare grpcio asyncio server of Triton's ``inference.GRPCInferenceService``
(the service tritonclient ships generated, ``tritonclient.grpc.service_pb2_grpc``) that parses each
``ModelInfer`` request and answers one fixed ``ModelInferResponse``, read from a file (the
benchmark writes edged's own answer to the same request there, so both answers have the same
size). No edged code: what any Python gRPC server pays before it runs a model.

    python -m bench.grpc_floor RESPONSE_FILE UNIX_PATH TCP_PORT

Listens on ``unix:UNIX_PATH`` and ``127.0.0.1:TCP_PORT``; answers ``ServerReady`` for readiness;
stops on SIGTERM.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc


class Floor(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    def __init__(self, response: Any) -> None:
        self.response = response

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerReadyResponse(ready=True)

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        return self.response


async def serve(response_file: Path, unix_path: str, port: int) -> None:
    response = service_pb2.ModelInferResponse.FromString(response_file.read_bytes())
    # The limits tritonclient sets on its side, so a frame-sized message passes either way.
    options = [("grpc.max_send_message_length", 2**31 - 1), ("grpc.max_receive_message_length", 2**31 - 1)]
    server = grpc.aio.server(options=options)
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Floor(response), server)
    server.add_insecure_port(f"unix:{unix_path}")
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(grace=1)


def main(argv: list[str]) -> int:
    asyncio.run(serve(Path(argv[0]), argv[1], int(argv[2])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
