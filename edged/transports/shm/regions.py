"""System shared memory regions (the Open Inference Protocol's system shared memory extension).

A client creates a POSIX shared memory object once, registers it under a region name, and then
names the region in each request. Every client is untrusted, so:

- A region belongs to the peer that registered it (SO_PEERCRED: uid and process). Names are per
  owner: only the owner process sees it, uses it or unregisters it (root sees every region in
  status). Its object is opened only when the object's owner uid is the peer's uid (or the peer is
  root), checked with fstat on the opened descriptor, so nobody reaches another user's object
  through the daemon's rights.
- The daemon never touches client pages through a mapping: an owner that shrinks its object would
  turn the next access into SIGBUS, which kills the process. The descriptor opened at
  registration is kept, inputs are copied in with pread into daemon-owned buffers and outputs
  written with pwrite after an fstat size check; a kernel copy cannot fault the process, and a
  short read is an error for that request only. Replacing the object's name after registration
  does not change the region: it stays bound to the object that was opened.
- Regions count against a total and a per-uid limit (each keeps a descriptor), and the regions of
  a process that exits are released (pidfd readable), so a client killed without cleaning up
  leaves nothing behind.

Bookkeeping runs on the event loop only; copies of large tensors run on a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import re
import select
import stat
from collections.abc import Callable
from dataclasses import dataclass, field

from edged.config import ServerConfig, parse_size
from edged.errors import (
    SharedMemoryError,
    SharedMemoryForbiddenError,
    SharedMemoryLimitError,
    SharedMemoryNotFoundError,
    SharedMemoryTooLargeError,
)
from edged.transports.peer import Peer
from edged.transports.shm.memfd import map_sealed, unmap_later

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_KEY_RE = re.compile(r"^/?[A-Za-z0-9_.@-]{1,200}$")
_NAME_MAX = 256
MEMFD_KEY = "memfd"  # what status shows as the key of a region registered by descriptor
_POLL_S = 2.0  # without pidfds (seccomp, old kernels) exited owners are found by polling


@dataclass(frozen=True)
class ShmLimits:
    max_regions: int = 1024
    max_regions_per_peer: int = 256
    max_region_size: int = 256 * 1024 * 1024
    max_region_bytes: int = 2 * 1024 * 1024 * 1024
    max_region_bytes_per_peer: int = 1024 * 1024 * 1024

    @classmethod
    def from_config(cls, server: ServerConfig) -> ShmLimits:
        return cls(
            server.max_regions,
            server.max_regions_per_peer,
            parse_size(server.max_region_size),
            parse_size(server.max_region_bytes),
            parse_size(server.max_region_bytes_per_peer),
        )


@dataclass(eq=False)
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    fd: int
    uid: int
    pid: int
    users: int = 0  # requests copying from or to it right now
    released: bool = False
    # A sealed memfd (memfd.py) is mapped instead: requests read and write it in place.
    mapping: mmap.mmap | None = None
    writable: bool = True
    allocated: bool = False  # every page of it allocated by the client (populating charges it nothing)
    # A mapped memfd's object (device, inode): one registered under two names is mapped twice.
    file: tuple[int, int] | None = None

    def status(self, with_owner: bool = False) -> dict[str, object]:
        doc: dict[str, object] = {
            "name": self.name,
            "key": self.key,
            "offset": self.offset,
            "byte_size": self.byte_size,
        }
        if with_owner:
            doc["owner_uid"], doc["owner_pid"] = self.uid, self.pid
        return doc

    def close_if_idle(self) -> None:
        if not self.released or self.users:
            return
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.mapping is not None:
            unmap_later(self.mapping)  # off the loop: the last unmap frees the pages
            self.mapping = None


@dataclass(eq=False)
class _Owner:
    """One registering process: its regions and the watch that releases them when it exits."""

    uid: int
    pid: int
    pidfd: int | None
    regions: dict[str, Region] = field(default_factory=dict)

    def exited(self) -> bool:
        if self.pidfd is not None:
            poller = select.poll()  # not select(): a pidfd may be above FD_SETSIZE
            poller.register(self.pidfd, select.POLLIN)
            return bool(poller.poll(0))
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


class SharedMemoryRegistry:
    def __init__(self, limits: ShmLimits | None = None, shm_dir: str = SHM_DIR) -> None:
        self.limits = limits or ShmLimits()
        self._dir = shm_dir
        self._owners: dict[tuple[int, int], _Owner] = {}
        self._count = 0
        self._bytes = 0
        self._bytes_per_uid: dict[int, int] = {}
        self._per_uid: dict[int, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._poller: asyncio.TimerHandle | None = None

    # --- registration ---

    def register(self, peer: Peer | None, name: str, key: str, offset: int, byte_size: int) -> None:
        """A POSIX shared memory object by its key (/dev/shm/<key>), copied in and out."""
        _check_args(name, key, offset, byte_size, self.limits.max_region_size)
        self._add(
            peer,
            name,
            byte_size,
            lambda p: Region(name, key, offset, byte_size, self._open(p, key, offset, byte_size), p.uid, p.pid),
        )

    def register_fd(self, peer: Peer | None, name: str, fd: int, seals: int, offset: int, byte_size: int) -> Region:
        """A sealed memfd the peer passed over the fd socket (``seals`` from memfd.sealable),
        mapped and used in place. Does not close ``fd`` (the mapping keeps its own reference)."""
        _check_args(name, MEMFD_KEY, offset, byte_size, self.limits.max_region_size)

        def mapped(p: Peer) -> Region:
            s = map_sealed(fd, seals, offset, byte_size)
            return Region(
                name,
                MEMFD_KEY,
                offset,
                byte_size,
                -1,
                p.uid,
                p.pid,
                mapping=s.mapping,
                writable=s.writable,
                allocated=s.allocated,
                file=s.file,
            )

        return self._add(peer, name, byte_size, mapped)

    def _add(self, peer: Peer | None, name: str, nbytes: int, make: Callable[[Peer], Region]) -> Region:
        peer = _local(peer)
        owner = self._owners.get((peer.uid, peer.pid))
        if owner is not None and owner.exited():
            self._reap(owner)  # its pid now names a new process: the old regions are not its
            owner = None
        if owner is not None and name in owner.regions:
            raise SharedMemoryError(f"shared memory region '{name}' is already registered")
        self._check_limits(peer.uid, nbytes)
        region = make(peer)
        try:
            if owner is None:
                owner = self._watch(peer)
        except BaseException:
            region.released = True
            region.close_if_idle()
            raise
        owner.regions[name] = region
        self._count += 1
        self._bytes += region.byte_size
        self._bytes_per_uid[peer.uid] = self._bytes_per_uid.get(peer.uid, 0) + region.byte_size
        self._per_uid[peer.uid] = self._per_uid.get(peer.uid, 0) + 1
        log.debug(
            "registered shared memory region %s (%s, %d bytes) for pid %d", name, region.key, region.byte_size, peer.pid
        )
        return region

    def _check_limits(self, uid: int, nbytes: int) -> None:
        lim = self.limits
        if self._bytes + nbytes > lim.max_region_bytes:
            raise SharedMemoryLimitError(
                f"registered regions hold {self._bytes} bytes; {nbytes} more would pass the limit "
                f"(server.max_region_bytes) of {lim.max_region_bytes}; unregister regions first"
            )
        mine = self._bytes_per_uid.get(uid, 0)
        if mine + nbytes > lim.max_region_bytes_per_peer:
            raise SharedMemoryLimitError(
                f"uid {uid} has regions of {mine} bytes registered; {nbytes} more would pass the limit "
                f"(server.max_region_bytes_per_peer) of {lim.max_region_bytes_per_peer}; unregister regions first"
            )
        if self._count >= lim.max_regions:
            raise SharedMemoryLimitError(
                f"{self._count} shared memory regions are registered, the limit (server.max_regions) "
                f"is {lim.max_regions}; unregister regions first"
            )
        mine = self._per_uid.get(uid, 0)
        if mine >= lim.max_regions_per_peer:
            raise SharedMemoryLimitError(
                f"uid {uid} has {mine} shared memory regions registered, the limit "
                f"(server.max_regions_per_peer) is {lim.max_regions_per_peer}; unregister regions first"
            )

    def _open(self, peer: Peer, key: str, offset: int, byte_size: int) -> int:
        path = os.path.join(self._dir, key.lstrip("/"))
        try:
            # O_NONBLOCK: a FIFO planted in /dev/shm must not block the loop in open().
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            raise SharedMemoryNotFoundError(
                f"shared memory key '{key}' does not exist (create it with shm_open first)"
            ) from None
        except OSError as e:
            raise SharedMemoryError(f"cannot open shared memory key '{key}': {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SharedMemoryError(f"shared memory key '{key}' is not a shared memory object")
            if peer.uid != 0 and st.st_uid != peer.uid:
                raise SharedMemoryForbiddenError(
                    f"shared memory key '{key}' belongs to another user: only its owner may register it"
                )
            if offset + byte_size > st.st_size:
                raise SharedMemoryError(
                    f"offset {offset} + byte_size {byte_size} exceeds the {st.st_size} bytes of '{key}'"
                )
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _watch(self, peer: Peer) -> _Owner:
        pidfd = os.dup(peer.pidfd) if peer.pidfd is not None else None
        owner = _Owner(peer.uid, peer.pid, pidfd)
        if owner.exited():
            if pidfd is not None:
                os.close(pidfd)
            raise SharedMemoryError(f"the process that opened this connection (pid {peer.pid}) has exited")
        self._owners[(peer.uid, peer.pid)] = owner
        loop = self._get_loop()
        if pidfd is not None:
            loop.add_reader(pidfd, self._on_exit, owner)
        elif self._poller is None:
            self._poller = loop.call_later(_POLL_S, self._poll)
        return owner

    def _get_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def _on_exit(self, owner: _Owner) -> None:
        if self._owners.get((owner.uid, owner.pid)) is owner:
            log.info("pid %d exited: releasing its %d shared memory regions", owner.pid, len(owner.regions))
            self._reap(owner)

    def _poll(self) -> None:
        self._poller = None
        for owner in [o for o in self._owners.values() if o.pidfd is None]:
            if owner.exited():
                self._on_exit(owner)
        if any(o.pidfd is None for o in self._owners.values()):
            self._poller = self._get_loop().call_later(_POLL_S, self._poll)

    def _reap(self, owner: _Owner) -> None:
        for name in list(owner.regions):
            self._drop(owner, name)

    def _drop(self, owner: _Owner, name: str) -> None:
        region = owner.regions.pop(name)
        region.released = True
        region.close_if_idle()
        self._count -= 1
        self._bytes -= region.byte_size
        self._bytes_per_uid[owner.uid] -= region.byte_size
        if not self._bytes_per_uid[owner.uid]:
            del self._bytes_per_uid[owner.uid]
        self._per_uid[owner.uid] -= 1
        if not self._per_uid[owner.uid]:
            del self._per_uid[owner.uid]
        if not owner.regions:
            del self._owners[(owner.uid, owner.pid)]
            if owner.pidfd is not None:
                if self._loop is not None:
                    self._loop.remove_reader(owner.pidfd)
                os.close(owner.pidfd)

    def unregister_for(self, peer: Peer | None, name: str | None = None) -> None:
        """One region of the peer, or all of them when ``name`` is None (root: every region).
        A region that is not registered is not an error (the extension's, and Triton's, rule)."""
        peer = _local(peer)
        if name is None and peer.uid == 0:
            owners = list(self._owners.values())
        else:
            owner = self._owners.get((peer.uid, peer.pid))
            owners = [owner] if owner is not None else []
        for owner in owners:
            for region in [name] if name is not None else list(owner.regions):
                if region in owner.regions:
                    self._drop(owner, region)

    def unregister(self) -> None:
        """Release every region of every owner (daemon stop)."""
        for owner in list(self._owners.values()):
            self._reap(owner)
        if self._poller is not None:
            self._poller.cancel()
            self._poller = None

    def status_for(self, peer: Peer | None, name: str | None = None) -> list[dict[str, object]]:
        peer = _local(peer)
        if name is None:
            if peer.uid == 0:
                return [r.status(True) for o in self._owners.values() for r in o.regions.values()]
            owner = self._owners.get((peer.uid, peer.pid))
            return [r.status() for r in owner.regions.values()] if owner else []
        return [self._region(peer, name).status()]

    def region_for(self, peer: Peer | None) -> Callable[[str], Region]:
        """Look up regions of ``peer`` by name (for copies.ShmRequest)."""
        return lambda name: self._region(_local(peer), name)

    def _region(self, peer: Peer, name: str) -> Region:
        owner = self._owners.get((peer.uid, peer.pid))
        region = owner.regions.get(name) if owner is not None else None
        if region is None:
            raise SharedMemoryNotFoundError(f"shared memory region '{name}' is not registered")
        return region

    def count(self) -> int:
        return self._count


def _local(peer: Peer | None) -> Peer:
    if peer is None:
        raise SharedMemoryError("shared memory is only available to local clients on the Unix socket")
    return peer


def _check_args(name: str, key: str, offset: int, byte_size: int, max_size: int) -> None:
    if not name or len(name) > _NAME_MAX:
        raise SharedMemoryError(f"a region needs a name of 1 to {_NAME_MAX} characters")
    if not isinstance(key, str) or not _KEY_RE.match(key) or key.strip("/") in ("", ".", ".."):
        raise SharedMemoryError(f"invalid shared memory key {key!r}")
    if offset < 0 or byte_size <= 0:
        raise SharedMemoryError("offset must be >= 0 and byte_size > 0")
    if byte_size > max_size:
        raise SharedMemoryTooLargeError(
            f"byte_size {byte_size} exceeds the largest region allowed (server.max_region_size, {max_size} bytes)"
        )
