"""The Python client of the socket (blocking and asyncio) and its shared-memory regions."""

from edged.client.clients import AsyncClient, Client
from edged.client.codec import decode_response, encode_request, raise_for
from edged.client.shm import MemfdRegion, ShmRegion, ShmTensor, memfd_supported

__all__ = [
    "AsyncClient",
    "Client",
    "MemfdRegion",
    "ShmRegion",
    "ShmTensor",
    "decode_response",
    "encode_request",
    "memfd_supported",
    "raise_for",
]
