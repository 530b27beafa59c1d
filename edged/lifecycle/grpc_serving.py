"""The daemon's gRPC listeners: started after HTTP's, stopped with them (drained as long)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable

from edged.config import Config
from edged.serving.service import Service
from edged.transports.budget import BodyBudget
from edged.transports.grpc.server import GrpcServer, grpc_socket_path
from edged.transports.shm.regions import SharedMemoryRegistry

log = logging.getLogger(__name__)

Bind = Callable[[str, int, str], socket.socket]


class GrpcListeners:
    def __init__(self) -> None:
        self.server: GrpcServer | None = None
        self.path: str | None = None

    async def start(
        self,
        cfg: Config,
        service: Service,
        shm: SharedMemoryRegistry,
        admin_gid: int | None,
        bind: Bind,
        bodies: BodyBudget,
    ) -> None:
        """``bodies``: the budget HTTP's request bodies draw on, which the gRPC socket's messages
        under way share."""
        path = grpc_socket_path(cfg)
        if path is None and not cfg.server.grpc_tcp:
            return
        server = GrpcServer(service, shm, cfg, admin_gid, bodies)
        sock = None
        if path is not None:
            # The HTTP socket's access list: its mode and group.
            sock = bind(path, int(cfg.server.socket_mode, 8), cfg.server.socket_group)
            self.path = path
        await server.start(sock, asyncio.get_running_loop())
        self.server = server
        where = [path] if path else []
        log.info("gRPC (KServe v2) on %s", ", ".join(where + list(cfg.server.grpc_tcp)))

    def stop_accepting(self) -> None:
        if self.server is not None:
            self.server.stop_accepting()

    async def stop(self, grace_s: float) -> None:
        if self.server is not None:
            await self.server.stop(grace_s)
            self.server = None
        if self.path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
