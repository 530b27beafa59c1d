"""The Python client for edged's Unix socket, blocking (``Client``) and asyncio (``AsyncClient``).

Both speak the Open Inference Protocol with the binary tensor extension, so tensors cross as raw
bytes. BYTES tensors (string models) are numpy object arrays of ``bytes`` (``str`` and numpy
``bytes_``/``str_`` arrays are sent too) and come back as object arrays of ``bytes``.

For frame-sized inputs, ``Client.infer_shm`` creates a POSIX shared memory region per input
once, registers it with the daemon once, and reuses it: only the frame's bytes are copied, into
the region, and nothing large crosses the socket. Its regions have names unique to the client
(``{model}.{input}.{pid}.{random}``), so programs and clients never collide; they are released on
close() and at interpreter exit, and the daemon releases those of a process that was killed.

The client stays light: numpy, orjson and the standard library (no msgspec, onnx, uvicorn).

Errors come back as the daemon's own exception classes (``edged.errors``), chosen by the stable
``code`` in the error body.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import os
import secrets
import socket
import struct
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import orjson

from edged import errors
from edged.client.codec import decode_response, encode_request, raise_for
from edged.client.shm import MemfdRegion, ShmRegion, ShmTensor, memfd_supported
from edged.paths import default_socket, fd_socket_for
from edged.wire.tensors import is_bytes

_JSON = {"Content-Type": "application/json"}


def _wire_size(arr: np.ndarray) -> int:
    """Bytes a tensor takes in binary form (a BYTES element: a 4-byte length and its bytes)."""
    if is_bytes(arr.dtype):
        return sum(4 + len(v.encode() if isinstance(v, str) else v) for v in arr.reshape(-1).tolist())
    return int(arr.nbytes)


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock

    def server_uid(self) -> int:
        """The daemon's user id, from the kernel (SO_PEERCRED), not from anything it says."""
        if self.sock is None:
            self.connect()
        cred = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return int(struct.unpack("3i", cred)[1])


class _Regions:
    """A client's registered regions, apart from the client so that a finalizer can release them
    at interpreter exit (or when the client is collected) without keeping the client alive."""

    def __init__(self, conn: _UnixConnection) -> None:
        self.conn = conn
        # slot -> region: the name given to shm_region(), or "{model}.{input}" for infer_shm (whose
        # regions are registered under a unique name, region.name)
        self.by_name: dict[str, ShmRegion | MemfdRegion] = {}

    def release(self) -> None:
        # At exit a hung daemon must not hold the program for the full request timeout.
        self.conn.timeout = min(self.conn.timeout or 2.0, 2.0)
        if self.conn.sock is not None:
            self.conn.sock.settimeout(self.conn.timeout)
        for region in self.by_name.values():
            with contextlib.suppress(Exception):  # the daemon may be gone; the region still closes
                self.conn.request("POST", f"/v2/systemsharedmemory/region/{region.name}/unregister", body=b"")
                self.conn.getresponse().read()
            region.close()
        self.by_name.clear()
        self.conn.close()


class Client:
    """Blocking client over one keep-alive connection (not thread-safe: one per thread)."""

    def __init__(self, socket_path: str | None = None, timeout: float = 30.0, memfd: bool = True) -> None:
        """``memfd=False`` registers POSIX shared memory objects even where the daemon takes
        sealed memfds (which it maps, so they cost no copy)."""
        self.socket_path = socket_path or default_socket()
        self._conn = _UnixConnection(self.socket_path, timeout)
        self._shm = _Regions(self._conn)
        self._memfd = memfd and memfd_supported()
        self._finalizer = weakref.finalize(self, self._shm.release)

    def request(
        self, method: str, path: str, body: bytes | None = None, headers: Mapping[str, str] | None = None
    ) -> tuple[int, bytes, http.client.HTTPResponse]:
        try:
            try:
                self._conn.request(method, path, body=body, headers=dict(headers or {}))
                resp = self._conn.getresponse()
            except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
                self._conn.close()  # the daemon closed an idle keep-alive connection: retry once
                self._conn.request(method, path, body=body, headers=dict(headers or {}))
                resp = self._conn.getresponse()
            return resp.status, resp.read(), resp
        except BaseException:
            self._conn.close()  # a failed exchange leaves the connection unusable: start afresh
            raise

    def _json(self, method: str, path: str, doc: Any = None) -> Any:
        body = orjson.dumps(doc) if doc is not None else (b"" if method == "POST" else None)
        status, data, _ = self.request(method, path, body, _JSON if body is not None else None)
        raise_for(status, data)
        return orjson.loads(data) if data else None

    def live(self) -> bool:
        return self.request("GET", "/v2/health/live")[0] == 200

    def ready(self) -> bool:
        return self.request("GET", "/v2/health/ready")[0] == 200

    def server_metadata(self) -> dict[str, Any]:
        return dict(self._json("GET", "/v2"))

    def model_metadata(self, model: str) -> dict[str, Any]:
        return dict(self._json("GET", f"/v2/models/{model}"))

    def model_ready(self, model: str) -> bool:
        return self.request("GET", f"/v2/models/{model}/ready")[0] == 200

    def status(self) -> dict[str, Any]:
        return dict(self._json("GET", "/v2/edged/status"))

    def repository_index(self) -> list[dict[str, Any]]:
        return list(self._json("POST", "/v2/repository/index"))

    def load(self, model: str) -> None:
        self._json("POST", f"/v2/repository/models/{model}/load")

    def unload(self, model: str) -> None:
        self._json("POST", f"/v2/repository/models/{model}/unload")

    def infer(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray | ShmTensor],
        outputs: Sequence[str] | None = None,
        request_id: str = "",
    ) -> dict[str, np.ndarray]:
        body, headers = encode_request(inputs, outputs, request_id)
        status, data, resp = self.request("POST", f"/v2/models/{model}/infer", body, headers)
        raise_for(status, data)
        hl = resp.getheader("Inference-Header-Content-Length")
        return decode_response(data, int(hl) if hl else None)

    # --- shared memory ---

    def register_shm(self, name: str, key: str, byte_size: int, offset: int = 0) -> None:
        self._json(
            "POST",
            f"/v2/systemsharedmemory/region/{name}/register",
            {"key": key, "offset": offset, "byte_size": byte_size},
        )

    def unregister_shm(self, name: str | None = None) -> None:
        path = f"/v2/systemsharedmemory/region/{name}/unregister" if name else "/v2/systemsharedmemory/unregister"
        self._json("POST", path)

    def shm_status(self) -> list[dict[str, Any]]:
        return list(self._json("GET", "/v2/systemsharedmemory/status"))

    def shm_region(self, name: str, byte_size: int) -> ShmRegion | MemfdRegion:
        """Create and register a region named ``name`` (or return the registered one if it is large
        enough): a sealed memfd where the daemon has its descriptor socket, else a POSIX shared
        memory object. Names are per process on the daemon's side; two clients of one process
        must choose different names (``infer_shm`` does)."""
        return self._region(name, name, byte_size)

    def _region(self, slot: str, name: str, byte_size: int) -> ShmRegion | MemfdRegion:
        regions = self._shm.by_name
        region = regions.get(slot)
        if region is not None and region.byte_size >= byte_size:
            return region
        if region is not None:
            del regions[slot]
            self.unregister_shm(region.name)
            region.close()
        region = self._memfd_region(name, byte_size) or self._posix_region(name, byte_size)
        regions[slot] = region
        return region

    def _memfd_region(self, name: str, byte_size: int) -> MemfdRegion | None:
        """None where the daemon takes no descriptors (an older one, or memfd_socket = false)."""
        if not self._memfd:
            return None
        try:
            region = MemfdRegion(name, byte_size)
        except OSError:  # memfd_create or sealing refused here (seccomp, an old kernel, a tmpfs quota)
            self._memfd = False
            return None
        try:
            region.register(fd_socket_for(self.socket_path), self._conn.timeout or 30.0)
        except (FileNotFoundError, ConnectionRefusedError):
            region.close()
            self._memfd = False  # asked once per client
            return None
        except TimeoutError:
            region.close()
            with contextlib.suppress(Exception):  # the daemon may have registered it after all
                self.unregister_shm(name)
            raise
        except BaseException:
            region.close()
            raise
        return region

    def _posix_region(self, name: str, byte_size: int) -> ShmRegion:
        region = ShmRegion(name, byte_size)
        try:
            self._share(region)
            self.register_shm(name, region.key, byte_size)
        except BaseException:
            region.close()
            raise
        # The daemon holds the object open now: without its name in /dev/shm, nothing is left
        # behind if this process is killed (the daemon releases the registration itself).
        region.unlink()
        return region

    def _share(self, region: ShmRegion) -> None:
        """The object is created 0600; a daemon running as another user gets an ACL entry."""
        uid = self._conn.server_uid()
        if uid != os.getuid() and not region.grant(uid):
            os.chmod(f"/dev/shm{region.key}", 0o660)  # no ACLs here: the group must do

    def infer_shm(
        self, model: str, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None, request_id: str = ""
    ) -> dict[str, np.ndarray]:
        """Send every input through a reused shared memory region (one per input name)."""
        try:
            return self.infer(model, self._shm_tensors(model, inputs), outputs, request_id)
        except errors.SharedMemoryNotFoundError:
            # The daemon restarted (and forgot the regions): register new ones, once.
            self._forget_regions(model)
            return self.infer(model, self._shm_tensors(model, inputs), outputs, request_id)

    def _shm_tensors(self, model: str, inputs: Mapping[str, np.ndarray]) -> dict[str, ShmTensor]:
        pid = os.getpid()
        return {
            n: self._region(f"{model}.{n}", f"{model}.{n}.{pid}.{secrets.token_hex(4)}", _wire_size(a)).put(a)
            for n, a in inputs.items()
        }

    def _forget_regions(self, model: str) -> None:
        for slot in [k for k in self._shm.by_name if k.startswith(f"{model}.")]:
            self._shm.by_name.pop(slot).close()

    def close(self) -> None:
        self._finalizer()  # unregisters and closes every region once, then the connection

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """asyncio client over one keep-alive connection; concurrent calls are serialised on it
    (open several clients for parallel requests). Responses are parsed by httptools."""

    def __init__(self, socket_path: str | None = None, timeout: float = 30.0) -> None:
        self.socket_path = socket_path or default_socket()
        self.timeout = timeout
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._lock = asyncio.Lock()

    async def _connect(self) -> None:
        self._reader, self._writer = await asyncio.open_unix_connection(self.socket_path)

    async def request(
        self, method: str, path: str, body: bytes = b"", headers: Mapping[str, str] | None = None
    ) -> tuple[int, bytes, dict[str, str]]:
        async with self._lock:
            try:
                return await asyncio.wait_for(self._roundtrip(method, path, body, headers), self.timeout)
            except BaseException:
                # Cancelled, timed out or failed mid-exchange: the answer may still arrive on this
                # connection and would be read as the next request's. Never reuse it.
                self._drop()
                raise

    def _drop(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None

    async def _roundtrip(
        self, method: str, path: str, body: bytes, headers: Mapping[str, str] | None
    ) -> tuple[int, bytes, dict[str, str]]:
        import httptools

        if self._writer is None or self._writer.is_closing():
            await self._connect()
        assert self._reader is not None and self._writer is not None
        lines = [f"{method} {path} HTTP/1.1", "Host: localhost", f"Content-Length: {len(body)}"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        self._writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        result = _Response()
        parser = httptools.HttpResponseParser(result)
        while not result.complete:
            chunk = await self._reader.read(1 << 20)
            if not chunk:
                self._writer.close()
                raise ConnectionError("edged closed the connection")
            parser.feed_data(chunk)
        return parser.get_status_code(), b"".join(result.body), result.headers

    async def ready(self) -> bool:
        return (await self.request("GET", "/v2/health/ready"))[0] == 200

    async def status(self) -> dict[str, Any]:
        status, body, _ = await self.request("GET", "/v2/edged/status")
        raise_for(status, body)
        return dict(orjson.loads(body))

    async def infer(
        self, model: str, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None, request_id: str = ""
    ) -> dict[str, np.ndarray]:
        body, headers = encode_request(inputs, outputs, request_id)
        status, data, resp_headers = await self.request("POST", f"/v2/models/{model}/infer", body, headers)
        raise_for(status, data)
        hl = resp_headers.get("inference-header-content-length")
        return decode_response(data, int(hl) if hl else None)

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            try:
                await self._writer.wait_closed()
            except OSError:
                pass
            self._writer = None


class _Response:
    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.body: list[bytes] = []
        self.complete = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode().lower()] = value.decode()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True
