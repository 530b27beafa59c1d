"""The Python client for edged's Unix socket, blocking (``Client``) and asyncio (``AsyncClient``).

Both speak the Open Inference Protocol with the binary tensor extension, so tensors cross as raw
bytes. For frame-sized inputs, ``Client.infer_shm`` creates a POSIX shared memory region per input
once, registers it with the daemon once, and reuses it: only the frame's bytes are copied, into
the region, and nothing large crosses the socket.

Errors come back as the daemon's own exception classes (``edged.errors``), chosen by the stable
``code`` in the error body.
"""

from __future__ import annotations

import asyncio
import http.client
import math
import mmap
import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import orjson

from edged import errors
from edged.paths import default_socket
from edged.protocol import V2_TO_NUMPY, v2_datatype

_JSON = {"Content-Type": "application/json"}


def _error_classes() -> dict[str, type[errors.EdgedError]]:
    table: dict[str, type[errors.EdgedError]] = {}
    stack: list[type[errors.EdgedError]] = [errors.EdgedError]
    while stack:
        cls = stack.pop()
        table.setdefault(cls.code, cls)
        stack.extend(cls.__subclasses__())
    return table


_ERRORS = _error_classes()


def raise_for(status: int, body: bytes) -> None:
    if status < 400:
        return
    try:
        doc = orjson.loads(body)
        message, code = str(doc.get("error", "")), str(doc.get("code", ""))
    except (orjson.JSONDecodeError, AttributeError):
        message, code = body.decode(errors="replace"), ""
    cls = _ERRORS.get(code, errors.EdgedError)
    raise cls(f"{message} (HTTP {status})")


def encode_request(
    inputs: Mapping[str, np.ndarray | ShmTensor],
    outputs: Sequence[str] | None = None,
    request_id: str = "",
    binary_outputs: bool = True,
) -> tuple[bytes, dict[str, str]]:
    metas: list[dict[str, Any]] = []
    chunks: list[bytes | memoryview] = []
    for name, value in inputs.items():
        if isinstance(value, ShmTensor):
            metas.append(value.meta(name))
            continue
        arr = np.ascontiguousarray(value)
        metas.append(
            {
                "name": name,
                "datatype": v2_datatype(arr.dtype.name),
                "shape": list(arr.shape),
                "parameters": {"binary_data_size": arr.nbytes},
            }
        )
        chunks.append(arr.reshape(-1).view(np.uint8).data)
    doc: dict[str, Any] = {"inputs": metas, "parameters": {"binary_data_output": binary_outputs}}
    if request_id:
        doc["id"] = request_id
    if outputs is not None:
        doc["outputs"] = [{"name": n, "parameters": {"binary_data": binary_outputs}} for n in outputs]
    header = orjson.dumps(doc)
    headers = {"Content-Type": "application/octet-stream" if chunks else "application/json"}
    if chunks:
        headers["Inference-Header-Content-Length"] = str(len(header))
    return b"".join([header, *chunks]), headers


def decode_response(body: bytes, header_len: int | None) -> dict[str, np.ndarray]:
    view = memoryview(body)
    doc = orjson.loads(view[:header_len] if header_len is not None else view)
    binary = view[header_len:] if header_len is not None else view[:0]
    out: dict[str, np.ndarray] = {}
    offset = 0
    for o in doc.get("outputs", []):
        dtype = np.dtype(V2_TO_NUMPY[o["datatype"]])
        shape = tuple(o["shape"])
        params = o.get("parameters") or {}
        if "binary_data_size" in params:
            size = params["binary_data_size"]
            out[o["name"]] = np.frombuffer(binary[offset : offset + size], dtype=dtype).reshape(shape)
            offset += size
        elif "data" in o:
            out[o["name"]] = np.asarray(o["data"], dtype=dtype).reshape(shape)
    return out


class ShmTensor:
    """An input already written into a registered region: only its name and place travel."""

    def __init__(
        self, region: str, arr_dtype: np.dtype[Any], shape: tuple[int, ...], nbytes: int, offset: int = 0
    ) -> None:
        self.region, self.dtype, self.shape, self.nbytes, self.offset = region, arr_dtype, shape, nbytes, offset

    def meta(self, name: str) -> dict[str, Any]:
        return {
            "name": name,
            "datatype": v2_datatype(self.dtype.name),
            "shape": list(self.shape),
            "parameters": {
                "shared_memory_region": self.region,
                "shared_memory_byte_size": self.nbytes,
                "shared_memory_offset": self.offset,
            },
        }


class ShmRegion:
    """A POSIX shared memory object this process created (``/dev/shm/<key>``), mapped once."""

    def __init__(self, name: str, byte_size: int, mode: int = 0o660) -> None:
        self.name = name
        self.key = f"/edged-{os.getpid()}-{name}"
        self.byte_size = byte_size
        path = f"/dev/shm{self.key}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, mode)
        try:
            os.ftruncate(fd, byte_size)
            self._map = mmap.mmap(fd, byte_size)
        finally:
            os.close(fd)
        self.array_view = np.frombuffer(self._map, dtype=np.uint8)

    def put(self, arr: np.ndarray, offset: int = 0) -> ShmTensor:
        data = np.ascontiguousarray(arr)
        if offset + data.nbytes > self.byte_size:
            raise ValueError(f"{data.nbytes} bytes do not fit region '{self.name}' ({self.byte_size})")
        self.array_view[offset : offset + data.nbytes] = data.reshape(-1).view(np.uint8)
        return ShmTensor(self.name, data.dtype, data.shape, data.nbytes, offset)

    def read(self, dtype: np.dtype[Any] | str, shape: Sequence[int], offset: int = 0) -> np.ndarray:
        dt = np.dtype(dtype)
        n = math.prod(shape) * dt.itemsize
        out: np.ndarray = self.array_view[offset : offset + n].view(dt).reshape(tuple(shape)).copy()
        return out

    def close(self) -> None:
        del self.array_view
        self._map.close()
        try:
            os.unlink(f"/dev/shm{self.key}")
        except FileNotFoundError:
            pass


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


class Client:
    """Blocking client over one keep-alive connection (not thread-safe: one per thread)."""

    def __init__(self, socket_path: str | None = None, timeout: float = 30.0) -> None:
        self.socket_path = socket_path or default_socket()
        self._conn = _UnixConnection(self.socket_path, timeout)
        self._regions: dict[str, ShmRegion] = {}

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

    def shm_region(self, name: str, byte_size: int) -> ShmRegion:
        """Create and register a region (or return the registered one if it is large enough)."""
        region = self._regions.get(name)
        if region is not None and region.byte_size >= byte_size:
            return region
        if region is not None:
            self.unregister_shm(name)
            region.close()
        region = ShmRegion(name, byte_size)
        try:
            self.register_shm(name, region.key, byte_size)
        except Exception:
            region.close()
            raise
        self._regions[name] = region
        return region

    def infer_shm(
        self, model: str, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None, request_id: str = ""
    ) -> dict[str, np.ndarray]:
        """Send every input through a reused shared memory region (one per input name)."""
        tensors = {n: self.shm_region(f"{model}.{n}", a.nbytes).put(a) for n, a in inputs.items()}
        return self.infer(model, tensors, outputs, request_id)

    def close(self) -> None:
        for name, region in self._regions.items():
            try:
                self.unregister_shm(name)
            except (errors.EdgedError, OSError):
                pass
            region.close()
        self._regions.clear()
        self._conn.close()

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
            return await asyncio.wait_for(self._roundtrip(method, path, body, headers), self.timeout)

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
