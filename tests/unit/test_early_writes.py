"""Outputs bound for shared memory written by the model's worker thread (edged/transports/
early_writes.py, through shm_io.ShmRequest): real memfd objects, a real mapping and real writer
threads; the encoder that claims what the worker wrote is the daemon's own."""

from __future__ import annotations

import asyncio
import functools
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from edged.backends.base import Instance, LoadOptions
from edged.backends.onnxruntime import OnnxRuntimeBackend
from edged.errors import BackendError, BadRequestError, SharedMemoryNotFoundError, SharedMemoryTruncatedError
from edged.serving.scheduler import ModelQueue
from edged.tools.demo import save_graph
from edged.transports.shm import copies as shm_io
from edged.transports.shm.regions import Region
from edged.transports.shm.worker_writes import EarlyWrites
from edged.wire import encode as encoding
from edged.wire.encode import encode_infer_parts
from edged.wire.tensors import InferRequest, OutputRequest
from tests.helpers import unavailable


@pytest.fixture(autouse=True)
def _memfd_create() -> None:
    if not hasattr(os, "memfd_create"):
        unavailable("no memfd_create on this platform")


SIZE = 1 << 22


@pytest.fixture
def regions() -> Iterator[dict[str, Region]]:
    """``posix``: written with the kernel's pwrite; ``mapped``: a writable mapping, as a sealed memfd is."""
    made: dict[str, Region] = {}
    for name in ("posix", "mapped"):
        fd = os.memfd_create(f"edged-unit-{name}", os.MFD_CLOEXEC)
        os.ftruncate(fd, SIZE)
        region = Region(name, "memfd", 0, SIZE, fd, os.getuid(), os.getpid())
        if name == "mapped":
            region.mapping = mmap.mmap(fd, SIZE)
        made[name] = region
    yield made
    for region in made.values():
        if region.mapping is not None:
            region.mapping.close()
        if region.fd >= 0:
            os.close(region.fd)


def lookup(regions: dict[str, Region]) -> Callable[[str], Region]:
    def find(name: str) -> Region:
        if name not in regions:
            raise SharedMemoryNotFoundError(f"shared memory region '{name}' is not registered")
        return regions[name]

    return find


def contents(region: Region, offset: int, nbytes: int) -> bytes:
    return os.pread(region.fd, nbytes, offset)


def outputs(*specs: tuple[str, str, int, int]) -> list[OutputRequest]:
    return [OutputRequest(name, False, region, offset, size) for name, region, offset, size in specs]


def on_a_thread(fn: Callable[[], None]) -> str:
    names: list[str] = []

    def run() -> None:
        fn()
        names.append(threading.current_thread().name)

    t = threading.Thread(target=run, name="fake-model-worker")
    t.start()
    t.join(10)
    assert names, "the writer thread did not finish"
    return names[0]


async def until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.001)


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


def test_a_large_output_is_run_straight_into_its_mapped_region(regions: dict[str, Region], model_dir: Path) -> None:
    # The tiny MLP on 16384 rows: 256 KiB of output, the size from which it is bound.
    backend = OnnxRuntimeBackend(model_dir / "tiny.onnx", LoadOptions(threads=1))
    backend.load()
    x = np.random.default_rng(5).standard_normal((16384, 16)).astype(np.float32)
    want = backend.instance().infer({"x": x})["probs"]
    outs = outputs(("probs", "mapped", 4096, want.nbytes))
    mapping = regions["mapped"].mapping
    assert mapping is not None
    start = np.frombuffer(mapping, np.uint8).ctypes.data

    async def main() -> list[bool]:
        q = ModelQueue("tiny", [backend.instance()], asyncio.get_running_loop(), depth=4)
        q.start()
        in_place = []
        for _ in range(3):  # the first run learns the output's shape, the next ones bind it
            shm = shm_io.ShmRequest(lookup(regions), None)
            early = shm.write_early(outs)
            out = await q.submit({"x": x}, 10, sink=early)
            in_place.append(start <= out["probs"].ctypes.data < start + SIZE)
            assert early.complete
            parts, _ = encode_infer_parts("tiny", InferRequest("", {}, outs), out, shm.output)
            assert shm.writes == [] and b"262144" in b"".join(bytes(p) for p in parts)
            np.testing.assert_array_equal(out["probs"], want)
            shm.release()
        q.close()
        q.join(10)  # no worker left holding a view of the mapping the fixture closes
        return in_place

    assert asyncio.run(main()) == [False, True, True]
    assert contents(regions["mapped"], 4096, want.nbytes) == want.tobytes()


def test_an_output_over_its_own_input_is_not_run_into(regions: dict[str, Region], model_dir: Path) -> None:
    # The client put the answer where its frame lies: the run must not overwrite what it reads.
    backend = OnnxRuntimeBackend(model_dir / "tiny.onnx", LoadOptions(threads=1))
    backend.load()
    x = np.random.default_rng(6).standard_normal((16384, 16)).astype(np.float32)
    want = backend.instance().infer({"x": x})["probs"]
    mapping = regions["mapped"].mapping
    assert mapping is not None
    frame = np.frombuffer(mapping, np.float32, x.size).reshape(x.shape)
    outs = outputs(("probs", "mapped", 4096, want.nbytes))

    async def main() -> None:
        q = ModelQueue("tiny", [backend.instance()], asyncio.get_running_loop(), depth=4)
        q.start()
        for _ in range(3):
            frame[:] = x
            shm = shm_io.ShmRequest(lookup(regions), None)
            early = shm.write_early(outs)
            out = await q.submit({"x": frame}, 10, sink=early)
            assert not np.may_share_memory(out["probs"], frame), "run into the bytes of its own input"
            np.testing.assert_array_equal(out["probs"], want)
            encode_infer_parts("tiny", InferRequest("", {}, outs), out, shm.output)
            shm.release()
        q.close()
        q.join(10)  # no worker left holding a view of the mapping the fixture closes

    asyncio.run(main())
    assert contents(regions["mapped"], 4096, want.nbytes) == want.tobytes()


class WrongShapesInstance(Instance):
    """Gives its output a shape other than the last run's on every call (pure logic): as a model
    whose output shape depends on its values does."""

    runs_into = True

    def __init__(self) -> None:
        self.backend = SimpleNamespace(name="fake")  # type: ignore[assignment]
        self.calls = 0
        self.into_calls = 0

    def _infer_impl(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.calls += 1
        return {"y": np.full((70_000 + self.calls,), 1, np.float32)}

    def _infer_into_impl(
        self, inputs: Mapping[str, np.ndarray], into: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        self.into_calls += 1
        raise RuntimeError("the computed output shape is not the one provided")


def test_a_model_whose_outputs_do_not_keep_their_shapes_is_copied_from_then_on(regions: dict[str, Region]) -> None:
    inst = WrongShapesInstance()
    outs = outputs(("y", "mapped", 0, SIZE))

    async def main() -> None:
        q = ModelQueue("m", [inst], asyncio.get_running_loop(), depth=4)
        q.start()
        for _ in range(3):
            shm = shm_io.ShmRequest(lookup(regions), None)
            early = shm.write_early(outs)
            out = await q.submit({"x": np.ones(1, np.float32)}, 10, sink=early)
            assert early.complete and out["y"].shape == (70_000 + inst.calls,)
            shm.release()
        q.close()
        q.join(10)  # no worker left holding a view of the mapping the fixture closes

    asyncio.run(main())
    assert inst.into_calls == 1 and not inst.runs_into, "the failed guess was not given up"
    assert inst.calls == 3  # the failed run into the region was made again, as a run alone


def passthrough_model(path: Path) -> Path:
    """Outputs ``x`` (its own input, passed through) and ``y = relu(x)``, any number of rows."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 16])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "passthrough", [x], [x, y])
    return save_graph(graph, path)  # an IR version every supported ONNX Runtime loads


def test_an_output_passed_through_from_an_input_is_copied_not_taken_as_written(
    regions: dict[str, Region], tmp_path: Path
) -> None:
    backend = OnnxRuntimeBackend(passthrough_model(tmp_path / "passthrough.onnx"), LoadOptions(threads=1))
    backend.load()
    x = np.random.default_rng(7).standard_normal((4096, 16)).astype(np.float32)  # 256 KiB each
    outs = outputs(("x", "mapped", 0, x.nbytes), ("y", "mapped", x.nbytes, x.nbytes))

    async def main() -> None:
        q = ModelQueue("p", [backend.instance()], asyncio.get_running_loop(), depth=4)
        q.start()
        for i in range(3):  # the second and third bind both outputs
            shm = shm_io.ShmRequest(lookup(regions), None)
            early = shm.write_early(outs)
            out = await q.submit({"x": x * (i + 1)}, 10, sink=early)
            assert early.complete
            encode_infer_parts("p", InferRequest("", {}, outs), out, shm.output)
            shm.release()
            assert contents(regions["mapped"], 0, x.nbytes) == (x * (i + 1)).tobytes(), f"request {i}"
            assert contents(regions["mapped"], x.nbytes, x.nbytes) == np.maximum(x * (i + 1), 0).tobytes()
        q.close()
        q.join(10)

    asyncio.run(main())


@pytest.fixture
def twice(regions: dict[str, Region]) -> Iterator[dict[str, Region]]:
    """``regions`` and "twice": the memfd of "mapped" registered a second time, so one object
    under two names, two mappings at two addresses over the same bytes."""
    mapped = regions["mapped"]
    st = os.fstat(mapped.fd)
    mapped.file = (st.st_dev, st.st_ino)  # as registration records it
    fd = os.dup(mapped.fd)
    again = Region("twice", "memfd", 0, SIZE, fd, os.getuid(), os.getpid(), file=mapped.file)
    again.mapping = mmap.mmap(fd, SIZE)
    yield {**regions, "twice": again}
    again.mapping.close()
    os.close(fd)


def test_a_memfd_registered_twice_is_not_run_into_where_an_input_lies(twice: dict[str, Region]) -> None:
    async def main() -> None:
        shm = shm_io.ShmRequest(lookup(twice), None)
        shm.input("mapped", 0, 1 << 20)
        early = shm.write_early(outputs(("y", "twice", 4096, 1 << 20), ("z", "twice", 2 << 20, 1 << 20)))
        shape = ((1 << 18,), np.dtype(np.float32))
        into = early.bind({"y": shape, "z": shape}, {})
        assert list(into) == ["z"], "bound over the bytes of an input read through another mapping"
        early.run({})
        shm.release()

    asyncio.run(main())


def test_a_request_failing_while_its_run_writes_learns_when_the_writes_end(regions: dict[str, Region]) -> None:
    async def main() -> None:
        shm = shm_io.ShmRequest(lookup(regions), None)
        early = shm.write_early(outputs(("y", "mapped", 0, 1 << 20)))
        assert early.settled() is None  # nothing under way
        into = early.bind({"y": ((1 << 18,), np.dtype(np.float32))}, {})
        settled = early.settled()
        assert into and settled is not None and not settled.done()
        worker = threading.Thread(target=early.run, args=({"y": into.pop("y")},))
        worker.start()
        await asyncio.wait_for(settled, 10)
        assert early.settled() is None
        worker.join(10)
        shm.release()

    asyncio.run(main())


def test_two_outputs_over_the_same_bytes_through_two_registrations_are_not_both_run_into(
    twice: dict[str, Region],
) -> None:
    # A later kernel may read an earlier output's array: the second is written after the run.
    async def main() -> None:
        shm = shm_io.ShmRequest(lookup(twice), None)
        early = shm.write_early(outputs(("a", "mapped", 0, 1 << 20), ("b", "twice", 4096, 1 << 20)))
        shape = ((1 << 18,), np.dtype(np.float32))
        assert list(early.bind({"a": shape, "b": shape}, {})) == ["a"]
        early.run({})
        shm.release()

    asyncio.run(main())


def test_a_failure_asking_while_nothing_gets_bound_is_not_held_for_the_run(regions: dict[str, Region]) -> None:
    asked: list[asyncio.Future[None] | None] = []
    held: list[EarlyWrites] = []

    class AskingShapes(dict[str, tuple[tuple[int, ...], "np.dtype[Any]"]]):
        """Asks for ``settled`` from inside ``bind``, between its two steps (as a deadline may)."""

        def get(self, key: str, default: Any = None) -> Any:
            asked.append(held[0].settled())
            return super().get(key, default)

    async def main() -> None:
        shm = shm_io.ShmRequest(lookup(regions), None)
        early = shm.write_early(outputs(("y", "mapped", 0, 1 << 20)))
        held.append(early)
        assert early.bind(AskingShapes(y=((16,), np.dtype(np.float32))), {}) == {}  # too small to bind
        settled = asked[0]
        assert settled is not None
        await asyncio.wait_for(settled, 10)  # resolved by bind itself, not by a run
        shm.release()  # and the worker, when it runs, writes nothing: the request is gone
        early.run({"y": np.ones(16, np.float32)})
        assert not early.complete

    asyncio.run(main())
    assert contents(regions["mapped"], 0, 64) == bytes(64)


def test_a_missed_shape_is_not_printed_by_onnx_runtime(model_dir: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # The daemon never prints: the miss is the scheduler's one warning, through logging.
    backend = OnnxRuntimeBackend(model_dir / "tiny.onnx", LoadOptions(threads=1))
    backend.load()
    inst = backend.instance()
    wrong = np.zeros((3, 4), np.float32)  # the run gives (2, 4)
    with pytest.raises(BackendError, match="shape"):
        inst.infer_into({"x": np.ones((2, 16), np.float32)}, {"probs": wrong})
    assert "onnxruntime" not in capfd.readouterr().err
