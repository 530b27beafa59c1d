"""The held swap (edged/serving/swap.py) over a real registry and real ONNX Runtime sessions: the swap a
reload and a background build both make when old and new do not fit in memory together.

The runtimes are the registry's own stand-ins (ONNX Runtime on the source model, no build), so
each test loads real sessions in well under a second.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from edged.cache.store import EngineCache
from edged.config import from_mapping
from edged.errors import CacheError
from edged.host.memory import probe_meminfo
from edged.lifecycle.reload import Reloader, _Txn
from edged.quantize.runner import BuildRunner
from edged.serving.background import BackgroundBuilds, stand_in
from edged.serving.metrics import Metrics
from edged.serving.registry import ModelRuntime, Registry
from edged.serving.states import ModelState
from edged.serving.swap import OnFailure, swap_held
from edged.tools.demo import make_tiny_mlp

X = {"x": np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)}


def runtime(reg: Registry, path: Path) -> ModelRuntime:
    """A runtime for model 'm' on ``path``, served by ONNX Runtime on the file as it is."""
    cfg = from_mapping({"models": {"m": {"path": str(path), "warmup": {"iterations": 1}}}}, base=path.parent)
    rt = ModelRuntime("m", cfg.models["m"])
    reg.resolve(rt)
    sub = stand_in(reg, rt)
    assert sub is not None
    return sub


def expected_output(path: Path) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, X)[0])


@pytest.fixture
def reg(tmp_path: Path) -> Registry:
    make_tiny_mlp(tmp_path / "old.onnx")
    cfg = from_mapping({"models": {"m": {"path": str(tmp_path / "old.onnx")}}}, base=tmp_path)
    return Registry(cfg, EngineCache(tmp_path / "cache"), BuildRunner(cfg.build, probe_meminfo), Metrics(), 1 << 30)


async def _serve_old(reg: Registry, tmp_path: Path) -> ModelRuntime:
    old = runtime(reg, tmp_path / "old.onnx")
    reg.models["m"] = old
    await reg.load(old, asyncio.get_running_loop())
    assert old.state == ModelState.READY
    return old


def test_requests_wait_on_the_hold_and_the_new_runtime_serves_when_it_lifts(reg: Registry, tmp_path: Path) -> None:
    new_path = make_tiny_mlp(tmp_path / "new.onnx", hidden=64)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        old = await _serve_old(reg, tmp_path)
        new = runtime(reg, new_path)
        expected = expected_output(new_path)

        async def no_failure(old: ModelRuntime, new: ModelRuntime) -> None:
            raise AssertionError("the new runtime loads")

        swap = loop.create_task(swap_held(reg, old, new, loop, "replaced in a test", no_failure))
        for _ in range(100):  # the hold is the swap's first step, before its first await
            if "m" in reg.holds:
                break
            await asyncio.sleep(0)
        held = reg.holds["m"]
        assert not held.is_set()
        await asyncio.wait_for(held.wait(), 30)  # what a request does while the hold is on
        # When the hold lifts, the registered runtime is the new one, warm, with its queue.
        assert reg.models["m"] is new and new.state == ModelState.READY and new.queue is not None
        out = await new.queue.submit(X, 10)
        np.testing.assert_allclose(next(iter(out.values())), expected, rtol=1e-5)
        await swap
        assert "m" not in reg.holds
        assert (old.state, old.reason, old.backend, old.queue) == (
            ModelState.UNLOADED,
            "replaced in a test",
            None,
            None,
        )
        await reg.unload(new)

    asyncio.run(main())


async def _failed_swap(reg: Registry, tmp_path: Path, on_failure: OnFailure) -> tuple[ModelRuntime, ModelRuntime]:
    """Swap a serving runtime for one whose model file is not a model; whatever the policy, the
    load error reaches the caller, the hold is released and the old runtime is registered."""
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not an onnx model")
    old = await _serve_old(reg, tmp_path)
    new = runtime(reg, broken)
    with pytest.raises(CacheError, match="does not load"):
        await swap_held(reg, old, new, asyncio.get_running_loop(), "replaced in a test", on_failure)
    assert "m" not in reg.holds and reg.models["m"] is old and new.backend is None
    return old, new


def test_a_new_runtime_that_does_not_load_puts_the_old_one_back_under_the_hold(reg: Registry, tmp_path: Path) -> None:
    """The failure policy of a background build: the old runtime is loaded again at once, while
    requests still wait."""
    seen: list[tuple[bool, bool, ModelState]] = []

    async def reload_old(o: ModelRuntime, n: ModelRuntime) -> None:
        seen.append((reg.models["m"] is o, not reg.holds["m"].is_set(), o.state))
        await reg.load(o, asyncio.get_running_loop())

    async def main() -> None:
        old, _ = await _failed_swap(reg, tmp_path, reload_old)
        assert seen == [(True, True, ModelState.UNLOADED)]  # registered again, still held, retired
        assert old.state == ModelState.READY and old.queue is not None
        out = await old.queue.submit(X, 10)
        assert next(iter(out.values())).shape == (1, 4)
        await reg.unload(old)

    asyncio.run(main())


def test_a_failure_policy_can_leave_the_old_runtime_to_a_later_rollback(reg: Registry, tmp_path: Path) -> None:
    """The failure policy of a reload: the swap is only recorded (the transaction's rollback loads
    the old runtime back); the old runtime stays registered, unloaded."""
    recorded: list[tuple[ModelRuntime, ModelRuntime]] = []

    async def later(o: ModelRuntime, n: ModelRuntime) -> None:
        recorded.append((o, n))

    async def main() -> None:
        old, new = await _failed_swap(reg, tmp_path, later)
        assert recorded == [(old, new)]
        assert old.state == ModelState.UNLOADED and old.backend is None

    asyncio.run(main())


def test_a_reload_rolls_back_its_held_swaps_when_one_fails(reg: Registry, tmp_path: Path) -> None:
    """The reload's side of the policy: a swap that went through and one whose new runtime did
    not load are both in the transaction, and its rollback serves the old runtimes again."""
    new_path = make_tiny_mlp(tmp_path / "new.onnx", hidden=64)
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not an onnx model")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        reloader = Reloader(
            reg, loop, lambda: "", lambda _: None, BackgroundBuilds(reg, loop, lambda: None, lambda: None)
        )
        old = await _serve_old(reg, tmp_path)
        new = runtime(reg, new_path)
        txn = _Txn()
        await reloader._swap_queued(old, new, txn)
        assert reg.models["m"] is new and txn.swapped == [(old, new)]
        again = runtime(reg, broken)
        with pytest.raises(CacheError):
            await reloader._swap_queued(new, again, txn)
        assert reg.models["m"] is new and txn.swapped == [(old, new), (new, again)]
        # Requests keep waiting until the rollback has loaded a runtime back: released now, they
        # would find 'new' unloaded and fail.
        waiting = reg.holds.get("m")
        assert waiting is not None and not waiting.is_set() and txn.holds == {"m": waiting}
        await reloader._rollback(txn)
        assert waiting.is_set() and not txn.holds  # newest first: new is loaded back, then old replaces it
        assert reg.models["m"] is old and old.state == ModelState.READY and old.queue is not None
        assert new.backend is None and again.backend is None and not reg.holds
        out = await old.queue.submit(X, 10)
        np.testing.assert_allclose(next(iter(out.values())), expected_output(tmp_path / "old.onnx"), rtol=1e-5)
        await reg.unload(old)

    asyncio.run(main())
