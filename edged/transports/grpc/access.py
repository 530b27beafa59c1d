"""What a gRPC call may do: its listener's bearer token (TCP), its Unix peer, the admin group."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable
from typing import Any

from edged.errors import ForbiddenError, UnauthorizedError
from edged.transports.peer import Peer, in_group


class Access:
    def __init__(
        self,
        token: bytes | None,
        peer_of: Callable[[str], Peer | None],
        admin_gid: int | None,
        called: Callable[[str], None] = lambda name: None,
    ) -> None:
        self.token = None if token is None else b"Bearer " + token
        # The Unix peer of a call, by ``context.peer()`` (the relay's record, peers.py); None for
        # a call that came over TCP.
        self.peer_of = peer_of
        self.admin_gid = admin_gid
        self.called = called  # told of each authorised call over TCP (the relay keeps its connection)

    def check(self, context: Any) -> Peer | None:
        """The call's Unix peer (None over TCP); over TCP with a token set, the token or
        unauthorized, as HTTP's TCP listeners answer. A call the relay does not know as a Unix
        peer's is held to TCP's rule."""
        name = context.peer()
        peer = self.peer_of(name)
        if peer is not None:
            return peer
        if self.token is not None:
            given = b""
            for key, value in context.invocation_metadata() or ():
                if key == "authorization":
                    given = value.encode("latin-1") if isinstance(value, str) else value
            if not hmac.compare_digest(given, self.token):
                raise UnauthorizedError("this listener needs 'authorization: Bearer <token>' (server.tcp_token_file)")
        self.called(name)
        return None

    async def admin(self, peer: Peer | None, what: str) -> None:
        gid = self.admin_gid
        if gid is None or (peer is not None and (peer.uid == 0 or peer.gid == gid)):
            return
        # Supplementary groups come from NSS, which may answer over the network: off the loop.
        if peer is None or not await asyncio.to_thread(in_group, peer, gid):
            raise ForbiddenError(f"only root and members of server.admin_group may {what}")
