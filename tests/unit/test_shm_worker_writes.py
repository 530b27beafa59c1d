"""Outputs bound for shared memory written by the model's worker thread (edged/transports/shm/
worker_writes.py, through shm_io.ShmRequest), and what the encoder does with what the worker
wrote or left: real memfd objects, a real mapping and real writer threads; the encoder that
claims what the worker wrote is the daemon's own."""

from __future__ import annotations

import asyncio
import functools
import os
import threading

import numpy as np
import pytest

from edged.errors import BadRequestError, SharedMemoryNotFoundError, SharedMemoryTruncatedError
from edged.transports.shm import copies as shm_io
from edged.transports.shm.regions import Region
from edged.wire import encode as encoding
from edged.wire.encode import encode_infer_parts
from edged.wire.tensors import InferRequest, OutputRequest
from tests.unit.early_writes_fixtures import (
    SIZE,
    contents,
    lookup,
    memfd_create_available,
    on_a_thread,
    outputs,
    regions,
    until,
)

__all__ = ["memfd_create_available", "regions"]  # fixtures: imported so that pytest finds them


def test_the_worker_writes_both_kinds_and_the_encoder_copies_nothing(regions: dict[str, Region]) -> None:
    y = np.arange(1000, dtype=np.float32).reshape(1, 1000)
    z = np.arange(10, dtype=np.int64)
    outs = outputs(("y", "mapped", 64, 4096), ("z", "posix", 128, 80))
    req = InferRequest("", {}, outs)

    async def main() -> None:
        shm = shm_io.ShmRequest(lookup(regions), None)
        early = shm.write_early(outs)
        results: dict[str, np.ndarray] = {"y": y, "z": z}
        on_a_thread(lambda: early.run(results))
        assert early.complete
        parts, _ = encode_infer_parts("m", req, results, shm.output)
        assert shm.writes == [], "the encoder made a copy the worker had made"
        assert b'"shared_memory_byte_size":4000' in b"".join(bytes(p) for p in parts)
        shm.release()
        assert all(r.users == 0 for r in regions.values())

    asyncio.run(main())
    assert contents(regions["mapped"], 64, y.nbytes) == y.tobytes()
    assert contents(regions["posix"], 128, z.nbytes) == z.tobytes()


def test_a_request_released_before_its_worker_writes_is_never_written(regions: dict[str, Region]) -> None:
    outs = outputs(("y", "mapped", 0, 64), ("z", "posix", 0, 64))

    async def main() -> None:
        shm = shm_io.ShmRequest(lookup(regions), None)
        early = shm.write_early(outs)
        shm.release()  # answered on the loop, failed or cancelled before the worker's turn
        assert all(r.users == 0 for r in regions.values())
        on_a_thread(lambda: early.run({"y": np.ones(16, np.float32), "z": np.ones(16, np.float32)}))
        assert not early.complete

    asyncio.run(main())
    assert contents(regions["mapped"], 0, 64) == bytes(64)
    assert contents(regions["posix"], 0, 64) == bytes(64)


def test_a_release_during_the_writes_holds_the_regions_until_they_end(
    regions: dict[str, Region], monkeypatch: pytest.MonkeyPatch
) -> None:
    inside, go = threading.Event(), threading.Event()
    real = shm_io._write_all

    def held_write(region: Region, pos: int, buf: np.ndarray) -> None:
        inside.set()
        assert go.wait(10)
        real(region, pos, buf)

    monkeypatch.setattr(shm_io, "_write_all", held_write)
    posix = regions["posix"]

    async def main() -> None:
        shm = shm_io.ShmRequest(lookup(regions), None)
        early = shm.write_early(outputs(("z", "posix", 0, 64)))
        worker = threading.Thread(target=early.run, args=({"z": np.full(16, 7, np.float32)},))
        worker.start()
        await until(inside.is_set, "the worker's write")
        posix.released = True  # unregistered meanwhile: the last user closes its descriptor
        shm.release()  # the request gives up while the worker writes
        assert posix.users == 1 and posix.fd >= 0, "the region was let go under a running write"
        go.set()
        await until(lambda: posix.fd < 0, "the region's release once the write ended")
        worker.join(10)
        assert posix.users == 0

    fd = posix.fd
    asyncio.run(main())
    with pytest.raises(OSError):
        os.fstat(fd)  # closed by the release, exactly once (the fixture sees fd -1)


def test_a_failed_write_is_raised_by_the_encoder(regions: dict[str, Region]) -> None:
    outs = outputs(("z", "posix", 1024, 64))
    req = InferRequest("", {}, outs)

    async def main() -> None:
        shm = shm_io.ShmRequest(lookup(regions), None)
        early = shm.write_early(outs)
        os.ftruncate(regions["posix"].fd, 512)  # the client shrank its object after registering it
        results = {"z": np.ones(16, np.float32)}
        on_a_thread(lambda: early.run(results))
        assert not early.complete
        with pytest.raises(SharedMemoryTruncatedError, match="was shrunk to 512 bytes"):
            encode_infer_parts("m", req, results, shm.output)
        shm.release()

    asyncio.run(main())


def test_outputs_the_worker_cannot_write_are_left_to_the_encoder(regions: dict[str, Region]) -> None:
    # Too large for the bytes it was given, sealed against writing, an unknown region: the
    # worker writes none of them, and the encoder says what it always said.
    regions["mapped"].writable = False
    cases: list[tuple[list[OutputRequest], type[Exception], str]] = [
        (outputs(("y", "posix", 0, 16)), BadRequestError, "needs 64 bytes, region 'posix' was given 16"),
        (outputs(("y", "mapped", 0, 64)), BadRequestError, "sealed against writing"),
        (outputs(("y", "nowhere", 0, 64)), SharedMemoryNotFoundError, "'nowhere' is not registered"),
    ]

    async def main() -> None:
        for outs, error, message in cases:
            shm = shm_io.ShmRequest(lookup(regions), None)
            early = shm.write_early(outs)
            results = {"y": np.ones(16, np.float32)}
            on_a_thread(functools.partial(early.run, results))
            with pytest.raises(error, match=message):
                encode_infer_parts("m", InferRequest("", {}, outs), results, shm.output)
            shm.release()
            assert all(r.users == 0 for r in regions.values())

    asyncio.run(main())
    assert contents(regions["posix"], 0, 64) == bytes(64)


def test_a_bytes_output_and_a_run_on_the_loop_are_written_by_the_encoder(regions: dict[str, Region]) -> None:
    words = np.array([b"edge", b"daemon"], dtype=object)
    floats = np.full(4, 3, np.float32)
    outs = outputs(("w", "posix", 0, 64), ("f", "mapped", 0, 16))
    req = InferRequest("", {}, outs)

    async def main() -> None:
        shm = shm_io.ShmRequest(lookup(regions), None)
        early = shm.write_early(outs)
        results = {"w": words, "f": floats}
        on_a_thread(lambda: early.run(results))  # writes the floats, leaves the BYTES output
        encode_infer_parts("m", req, results, shm.output)
        await shm.flush()
        shm.release()
        # A run made on the loop: the worker never ran, the encoder writes everything.
        shm = shm_io.ShmRequest(lookup(regions), None)
        shm.write_early(outs)
        encode_infer_parts("m", req, {"w": words, "f": -floats}, shm.output)
        await shm.flush()
        shm.release()

    asyncio.run(main())
    assert contents(regions["posix"], 0, 4) == (4).to_bytes(4, "little")  # BYTES: length-prefixed
    assert np.frombuffer(contents(regions["mapped"], 0, 16), np.float32).tolist() == [-3.0] * 4


@pytest.mark.parametrize("when", ["before the worker writes", "after the worker wrote"])
def test_a_region_registered_again_under_its_name_gets_the_answer(regions: dict[str, Region], when: str) -> None:
    outs = outputs(("y", "posix", 0, 64))
    req = InferRequest("", {}, outs)
    y = np.arange(16, dtype=np.float32)
    fd = os.memfd_create("edged-unit-again", os.MFD_CLOEXEC)
    os.ftruncate(fd, SIZE)
    again = Region("posix", "memfd", 0, SIZE, fd, os.getuid(), os.getpid())
    old = regions["posix"]

    def register_again() -> None:
        old.released = True
        regions["posix"] = again

    async def main() -> None:
        shm = shm_io.ShmRequest(lookup(regions), None)
        early = shm.write_early(outs)
        if when == "before the worker writes":
            register_again()
        on_a_thread(functools.partial(early.run, {"y": y}))
        if when == "after the worker wrote":
            register_again()
        encode_infer_parts("m", req, {"y": y}, shm.output)
        await shm.flush()
        shm.release()

    try:
        asyncio.run(main())
        assert contents(again, 0, 64) == y.tobytes(), "the region the name stands for now did not get the answer"
    finally:
        regions["posix"] = old
        os.close(fd)


def test_a_region_unregistered_during_the_run_is_not_found(regions: dict[str, Region]) -> None:
    outs = outputs(("y", "mapped", 0, 64))

    async def main() -> None:
        shm = shm_io.ShmRequest(lookup(regions), None)
        early = shm.write_early(outs)
        gone = regions.pop("mapped")
        try:
            gone.released = True
            on_a_thread(functools.partial(early.run, {"y": np.ones(16, np.float32)}))
            with pytest.raises(SharedMemoryNotFoundError, match="'mapped' is not registered"):
                encode_infer_parts("m", InferRequest("", {}, outs), {"y": np.ones(16, np.float32)}, shm.output)
            assert contents(gone, 0, 64) == bytes(64), "a region given up was written"
        finally:
            gone.released = False  # the fixture closes it
            regions["mapped"] = gone
        shm.release()

    asyncio.run(main())


def test_a_large_answer_with_a_bytes_output_copies_nothing_twice(regions: dict[str, Region]) -> None:
    big = np.arange(100_000, dtype=np.float32)  # over OFFLOAD_BYTES: the large path
    words = np.array([b"abcd"], dtype="S4")  # fixed-width bytes: BYTES too, never written raw
    outs = outputs(("y", "posix", 0, big.nbytes), ("w", "mapped", 0, 64))
    req = InferRequest("", {}, outs)

    async def main() -> None:
        shm = shm_io.ShmRequest(lookup(regions), None)
        early = shm.write_early(outs)
        results = {"y": big, "w": words}
        on_a_thread(functools.partial(early.run, results))
        await encoding.encode_large_async("m", req, results, shm.output, early.complete)
        assert shm.writes == [], "the worker's write was made again"
        shm.release()

    asyncio.run(main())
    assert contents(regions["posix"], 0, big.nbytes) == big.tobytes()
    assert contents(regions["mapped"], 0, 8) == (4).to_bytes(4, "little") + b"abcd"
