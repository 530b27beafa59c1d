"""A request's shared memory, made only when it names a region (few do): the holder every
transport's infer path uses (HTTP's and gRPC's), and the copies of its inputs before a run."""

from __future__ import annotations

from edged.transports.peer import Peer
from edged.transports.shm.copies import ShmRequest
from edged.transports.shm.regions import SharedMemoryRegistry
from edged.wire.decode import InferRequest, resolve_pending_async


async def fill_inputs(req: InferRequest, shm: LazyShm) -> None:
    """Inputs copied out of client memory, then BYTES inputs read, before the model sees them."""
    if shm.held is not None and shm.held.reads:
        await shm.held.fill()  # inputs are copied out of client memory before the model sees them
    if req.pending:  # BYTES inputs are read once their bytes are copied (or, mapped, at once)
        await resolve_pending_async(req)


class LazyShm:
    """The request's ShmRequest, made only when the request names a region (few do)."""

    __slots__ = ("held", "peer", "regions")
    held: ShmRequest | None

    def __init__(self, regions: SharedMemoryRegistry, peer: Peer | None) -> None:
        self.regions, self.peer, self.held = regions, peer, None

    def request(self) -> ShmRequest:
        if self.held is None:
            self.held = ShmRequest(self.regions.region_for(self.peer), self.peer)
        return self.held

    def input(self, name: str, offset: int, size: int) -> memoryview:
        return self.request().input(name, offset, size)

    def output(self, name: str, offset: int, size: int) -> memoryview | None:
        return self.request().output(name, offset, size)

    def written_ns(self) -> int:
        """How long the model's worker took writing outputs into shared memory (EarlyWrites)."""
        early = None if self.held is None else self.held.early
        return 0 if early is None else early.written_ns

    def take(self) -> LazyShm:
        """A holder of this request's ShmRequest, for the rest of the answer; this one then holds none."""
        taken = LazyShm(self.regions, self.peer)
        taken.held, self.held = self.held, None
        return taken

    def release(self) -> None:
        if self.held is not None:
            self.held.release()
