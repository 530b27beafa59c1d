"""Client-side shared memory: the regions a client maps and registers with the daemon.

- ``MemfdRegion`` (Linux, preferred): a memfd sealed against shrinking, handed to the daemon over
  its descriptor socket (``<socket>.fd``, SCM_RIGHTS). The daemon maps it too and reads inputs
  and writes outputs in place: no copy, and no name in /dev/shm that anybody could open.
- ``ShmRegion``: a POSIX shared memory object registered by its key (the Open Inference
  Protocol's system shared memory, as Triton's clients use it); the daemon copies in and out.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import math
import mmap
import os
import secrets
import socket
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson
from numpy.typing import DTypeLike

from edged import errors
from edged.wire.tensors import datatype_of, tensor_bytes

# Sealed against shrinking (what lets the daemon map it), growing, and further seal changes.
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL if hasattr(fcntl, "F_SEAL_SHRINK") else 0


class ShmTensor:
    """An input already written into a registered region: only its name and place travel."""

    def __init__(
        self, region: str, arr_dtype: np.dtype[Any], shape: tuple[int, ...], nbytes: int, offset: int = 0
    ) -> None:
        self.region, self.dtype, self.shape, self.nbytes, self.offset = region, arr_dtype, shape, nbytes, offset

    def meta(self, name: str) -> dict[str, Any]:
        return {
            "name": name,
            "datatype": datatype_of(self.dtype),
            "shape": list(self.shape),
            "parameters": {
                "shared_memory_region": self.region,
                "shared_memory_byte_size": self.nbytes,
                "shared_memory_offset": self.offset,
            },
        }


# POSIX ACL xattr (linux/posix_acl_xattr.h): version 2, then (tag, perm, id) entries by tag.
_ACL_USER_OBJ, _ACL_USER, _ACL_GROUP_OBJ, _ACL_MASK, _ACL_OTHER = 0x01, 0x02, 0x04, 0x10, 0x20
_ACL_UNDEFINED = 0xFFFFFFFF


class _Mapped:
    """Memory this process mapped and a daemon reads and writes: tensors go in and out here."""

    name: str
    key: str
    byte_size: int
    _map: mmap.mmap
    array_view: np.ndarray

    def put(self, arr: np.ndarray, offset: int = 0) -> ShmTensor:
        """Write a tensor (a BYTES one in its length-prefixed form) at ``offset``."""
        data = np.asarray(arr)
        raw = np.frombuffer(tensor_bytes(data), dtype=np.uint8)
        if offset + raw.nbytes > self.byte_size:
            raise ValueError(f"{raw.nbytes} bytes do not fit region '{self.name}' ({self.byte_size})")
        self.array_view[offset : offset + raw.nbytes] = raw
        return ShmTensor(self.name, data.dtype, data.shape, raw.nbytes, offset)

    def read(self, dtype: DTypeLike, shape: Sequence[int], offset: int = 0) -> np.ndarray:
        dt = np.dtype(dtype)
        n = math.prod(shape) * dt.itemsize
        out: np.ndarray = self.array_view[offset : offset + n].view(dt).reshape(tuple(shape)).copy()
        return out

    def unlink(self) -> None:
        """Nothing to remove by default (a memfd has no name anywhere)."""

    def close(self) -> None:
        if hasattr(self, "array_view"):
            del self.array_view
            self._map.close()
        self.unlink()


class ShmRegion(_Mapped):
    """A POSIX shared memory object this process created (``/dev/shm/<key>``), mapped once."""

    def __init__(self, name: str, byte_size: int, mode: int = 0o600) -> None:
        self.name = name
        # Unique, never derived from the region name alone: a key left by a killed process, or
        # one a second client of this process holds, must not collide with this one.
        self.key = f"/edged-{os.getpid()}-{secrets.token_hex(6)}"
        self.byte_size = byte_size
        path = f"/dev/shm{self.key}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, mode)
        try:
            os.ftruncate(fd, byte_size)
            self._map = mmap.mmap(fd, byte_size)
        finally:
            os.close(fd)
        self.array_view = np.frombuffer(self._map, dtype=np.uint8)

    def grant(self, uid: int) -> bool:
        """Let user ``uid`` (the daemon's) read and write this object, and nobody else: a POSIX
        ACL entry, not a group mode (every member of a group could open the object directly).
        False where the file system has no ACLs."""
        entries = [(_ACL_USER_OBJ, 6, _ACL_UNDEFINED), (_ACL_USER, 6, uid), (_ACL_GROUP_OBJ, 0, _ACL_UNDEFINED)]
        entries += [(_ACL_MASK, 6, _ACL_UNDEFINED), (_ACL_OTHER, 0, _ACL_UNDEFINED)]
        blob = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)
        try:
            os.setxattr(f"/dev/shm{self.key}", "system.posix_acl_access", blob)
        except OSError:
            return False
        return True

    def unlink(self) -> None:
        """Remove the name from /dev/shm; the memory lives on while it is mapped or registered."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm{self.key}")


class MemfdRegion(_Mapped):
    """A sealed memfd this process created and mapped; ``register`` hands it to the daemon."""

    key = "memfd"

    def __init__(self, name: str, byte_size: int) -> None:
        self.name = name
        self.byte_size = byte_size
        self._fd = os.memfd_create(f"edged-{name}"[:240], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self._fd, byte_size)
            # Allocated here, so charged to this process: the daemon faults in (and so takes
            # the charge for) nothing it has to allocate itself, and skips that for holes.
            os.posix_fallocate(self._fd, 0, byte_size)
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, _SEALS)
            self._map = mmap.mmap(self._fd, byte_size)
        except BaseException:
            os.close(self._fd)
            raise
        self.array_view = np.frombuffer(self._map, dtype=np.uint8)

    def register(self, fd_socket: str, timeout: float) -> None:
        """Hand the memfd to the daemon as region ``name``; FileNotFoundError or
        ConnectionRefusedError where the daemon has no descriptor socket."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.settimeout(timeout)
            sock.connect(fd_socket)
            doc = orjson.dumps({"name": self.name, "byte_size": self.byte_size, "offset": 0})
            sock.sendmsg([doc], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [self._fd]))])
            answer = orjson.loads(sock.recv(4096) or b"{}")
        if "registered" not in answer:
            code = str(answer.get("code", ""))
            raise _error_class(code)(str(answer.get("error", "the daemon closed the descriptor socket")))
        # The daemon holds its own mapping now; the mapping here keeps the memory for this side.
        os.close(self._fd)
        self._fd = -1

    def close(self) -> None:
        super().close()
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1


def memfd_supported() -> bool:
    return hasattr(os, "memfd_create") and bool(_SEALS)


def _error_class(code: str) -> type[errors.EdgedError]:
    found = errors.wire_codes().get(code)
    return found.cls if found is not None else errors.SharedMemoryError
