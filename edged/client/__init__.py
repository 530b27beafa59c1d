"""The Python client of the socket (blocking and asyncio) and its shared-memory regions."""

from edged.client.clients import AsyncClient, Client, decode_response, encode_request, raise_for

__all__ = ["AsyncClient", "Client", "decode_response", "encode_request", "raise_for"]
