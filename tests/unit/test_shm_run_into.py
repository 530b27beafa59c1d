"""Models run straight into the shared memory their outputs are bound for (EarlyWrites.bind,
through the scheduler's ``sink``): a large output bound into its mapped region but never over the
bytes of an input or of another output (even through a second registration of the same memfd),
a model whose output shapes change copied from then on, and a request failing while its run
writes learning when the writes end. Real ONNX Runtime models, memfd objects and mappings; a
fake instance where only the scheduler's logic is under test."""

from __future__ import annotations

import asyncio
import mmap
import os
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from edged.backends.base import Instance, LoadOptions
from edged.backends.onnxruntime import OnnxRuntimeBackend
from edged.errors import BackendError
from edged.serving.scheduler import ModelQueue
from edged.tools.demo import save_graph
from edged.transports.shm import copies as shm_io
from edged.transports.shm.regions import Region
from edged.transports.shm.worker_writes import EarlyWrites
from edged.wire.encode import encode_infer_parts
from edged.wire.tensors import InferRequest
from tests.unit.early_writes_fixtures import SIZE, contents, lookup, memfd_create_available, outputs, regions

__all__ = ["memfd_create_available", "regions"]  # fixtures: imported so that pytest finds them


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
