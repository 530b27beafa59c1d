"""edged/transports/shm/memfd.py: which descriptors may be mapped, and faulting a mapping in."""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from edged.errors import SharedMemoryError
from edged.transports.shm.memfd import map_sealed, mapping_address, populate, sealable, unmap
from edged.wire.tensors import from_bytes
from tests.helpers import unavailable

SEALED = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


@pytest.fixture
def fds() -> Iterator[list[int]]:
    opened: list[int] = []
    yield opened
    for fd in opened:
        os.close(fd)


def memfd(fds: list[int], size: int, seals: int = SEALED) -> int:
    fd = os.memfd_create("edged-unit", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    fds.append(fd)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def seals_of(fd: int) -> int:
    seals = sealable(fd)
    assert seals is not None
    return seals


def resident_kib(mapping_start: int) -> int:
    """Rss of this process's mapping that starts at ``mapping_start``, from /proc/self/smaps."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] == f"{mapping_start:x}":
            for follow in lines[i + 1 :]:
                if follow.startswith("Rss:"):
                    return int(follow.split()[1])
    raise AssertionError("mapping not found")


def test_a_sealed_memfd_maps_writable_and_its_bytes_are_the_clients(fds: list[int]) -> None:
    fd = memfd(fds, 8192, seals=0)
    os.pwrite(fd, b"frame", 4096)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALED)
    sealed = map_sealed(fd, seals_of(fd), 4096, 4096)
    assert sealed.writable and sealed.size == 8192
    assert sealed.mapping[4096:4101] == b"frame"
    sealed.mapping[0:2] = b"ok"
    assert os.pread(fd, 2, 0) == b"ok"
    assert unmap(sealed.mapping)


def test_a_write_sealed_memfd_maps_read_only(fds: list[int]) -> None:
    fd = memfd(fds, 4096, seals=fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE)
    sealed = map_sealed(fd, seals_of(fd), 0, 4096)
    assert not sealed.writable
    with pytest.raises(TypeError):
        sealed.mapping[0:1] = b"x"
    unmap(sealed.mapping)


@pytest.mark.parametrize(
    ("seals", "needle"),
    [(0, "F_SEAL_SHRINK"), (fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL, "F_SEAL_SHRINK")],
)
def test_a_memfd_that_can_shrink_is_refused(fds: list[int], seals: int, needle: str) -> None:
    fd = memfd(fds, 4096, seals)
    with pytest.raises(SharedMemoryError, match=needle):
        map_sealed(fd, seals_of(fd), 0, 4096)


def test_other_descriptors_have_no_seals_and_are_never_looked_at_further(fds: list[int], tmp_path: Path) -> None:
    """F_GET_SEALS is the first question: it answers EINVAL for a pipe, a file, a socket without
    asking any file system (an fstat of a FUSE file could block the daemon)."""
    r, w = os.pipe()
    fds += [r, w]
    f = tmp_path / "file"
    f.write_bytes(bytes(4096))
    fd = os.open(f, os.O_RDWR)
    fds.append(fd)
    sock = socket.socket()
    fds.append(sock.detach())
    assert [sealable(x) for x in (r, fd, fds[-1])] == [None, None, None]
    assert sealable(memfd(fds, 4096)) == SEALED


def test_a_hugetlb_memfd_is_refused(fds: list[int]) -> None:
    """Sealed against shrinking, but a hole punched in it gives its huge pages back: SIGBUS."""
    try:
        fd = os.memfd_create("edged-huge", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | os.MFD_HUGETLB)
    except OSError as e:
        unavailable(f"no hugetlbfs memfd here: {e}")
    fds.append(fd)
    try:
        os.ftruncate(fd, 2 << 20)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALED)
    except OSError as e:
        unavailable(f"cannot size or seal a hugetlbfs memfd here: {e}")
    with pytest.raises(SharedMemoryError, match="hugetlbfs"):
        map_sealed(fd, seals_of(fd), 0, 4096)


def test_a_range_past_the_end_is_refused(fds: list[int]) -> None:
    fd = memfd(fds, 4096)
    with pytest.raises(SharedMemoryError, match="exceeds the memfd's 4096 bytes"):
        map_sealed(fd, seals_of(fd), 1, 4096)


def test_unmap_waits_for_the_last_view(fds: list[int]) -> None:
    fd = memfd(fds, 4096)
    sealed = map_sealed(fd, seals_of(fd), 0, 4096)
    view = memoryview(sealed.mapping)
    assert not unmap(sealed.mapping)  # a request still reads it: left to the last view
    view.release()
    assert unmap(sealed.mapping)


def test_an_input_tensor_over_the_mapping_holds_it_as_a_view_does(fds: list[int]) -> None:
    """A model may still run on a tensor over a region whose request has ended (a deadline): the
    tensor must keep the mapping, or unmapping it would leave the model reading unmapped memory."""
    fd = memfd(fds, 4096)
    sealed = map_sealed(fd, seals_of(fd), 0, 4096)
    view = memoryview(sealed.mapping)[0:64].toreadonly()  # what a request's input resolves to
    tensor = from_bytes(view, np.dtype(np.float32), (4, 4), "input 'x'")
    view.release()
    assert not unmap(sealed.mapping)
    assert float(tensor.sum()) == 0.0
    del tensor
    assert unmap(sealed.mapping)


@pytest.mark.parametrize("writable", [True, False])
def test_populate_makes_the_range_resident(fds: list[int], writable: bool) -> None:
    size = 64 * mmap.PAGESIZE
    fd = memfd(fds, size)
    sealed = map_sealed(fd, seals_of(fd), 0, size)
    anchor = ctypes.c_char.from_buffer(sealed.mapping)
    address = ctypes.addressof(anchor)
    del anchor
    assert resident_kib(address) == 0
    populate(sealed.mapping, mmap.PAGESIZE + 1, size - mmap.PAGESIZE - 1, writable)
    assert resident_kib(address) >= (size - mmap.PAGESIZE) // 1024
    unmap(sealed.mapping)


def test_populate_takes_the_read_only_mapping_of_a_write_sealed_memfd(fds: list[int]) -> None:
    """A write-sealed memfd's mapping is read-only, which ctypes' from_buffer refuses: its address
    is found another way, so its populate works (failing, with a TypeError logged, it would leave
    every write-sealed region's first frame to pay the faults)."""
    size = 64 * mmap.PAGESIZE
    fd = memfd(fds, size, seals=0)
    os.posix_fallocate(fd, 0, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALED | fcntl.F_SEAL_WRITE)
    sealed = map_sealed(fd, seals_of(fd), 0, size)
    assert not sealed.writable
    address = mapping_address(sealed.mapping)
    assert resident_kib(address) == 0
    populate(sealed.mapping, 0, size, sealed.writable)
    assert resident_kib(address) >= size // 1024
    assert unmap(sealed.mapping)  # no export of the mapping left behind
