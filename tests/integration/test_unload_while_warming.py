"""The repository API's unload of a model whose load is still warming it: refused with a precise
error, and the load ends READY with its backend (unloaded under the warm-up, the model would come
back READY with no backend, its sessions alive and its memory no longer counted).

A real registry, backend and service over the tiny MLP; the instance wrapper (a test hook,
like edged/lifecycle/faults.py's) holds the warm-up's first run on its thread until the unload was tried."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

from edged.backends.base import Instance
from edged.cache.store import EngineCache
from edged.config import from_mapping
from edged.errors import ModelNotReadyError
from edged.host.memory import probe_meminfo
from edged.quantize.runner import BuildRunner
from edged.serving.admission import plan
from edged.serving.background import stand_in
from edged.serving.metrics import Metrics
from edged.serving.registry import ModelRuntime, Registry
from edged.serving.service import Service
from edged.serving.states import ModelState
from edged.tools.demo import make_tiny_mlp

pytestmark = pytest.mark.integration


class HeldWarmUp(Instance):
    """The wrapped instance, whose first run waits for ``release`` (set by the test)."""

    warming = threading.Event()
    release = threading.Event()

    def __init__(self, inner: Instance) -> None:
        super().__init__(inner.backend, inner.threads)
        self._inner = inner

    def _infer_impl(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        HeldWarmUp.warming.set()
        if not HeldWarmUp.release.wait(30):
            raise TimeoutError("the test never released the warm-up")
        return self._inner._infer_impl(inputs)


def test_an_unload_during_the_warm_up_is_refused_and_the_model_serves(tmp_path: Path) -> None:
    model = make_tiny_mlp(tmp_path / "m.onnx")
    cfg = from_mapping({"models": {"m": {"path": str(model), "threads": 1}}}, base=tmp_path)
    metrics = Metrics()
    reg = Registry(
        cfg,
        EngineCache(tmp_path / "cache"),
        BuildRunner(cfg.build, probe_meminfo),
        metrics,
        1 << 30,
        wrap_instance=HeldWarmUp,
    )
    wanted = ModelRuntime("m", cfg.models["m"])
    reg.resolve(wanted)
    rt = stand_in(reg, wanted)  # the model on ONNX Runtime, served at once (no build to wait for)
    assert rt is not None
    reg.models["m"] = rt

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        svc = Service(reg, metrics, loop, probe_meminfo(), plan([], 1 << 30))
        load = loop.create_task(reg.load(rt, loop))
        while not HeldWarmUp.warming.is_set():
            await asyncio.sleep(0.001)  # polls a thread's event, bounded by the load's own timeout
        assert rt.state == ModelState.WARMING and rt.backend is not None
        with pytest.raises(ModelNotReadyError, match="'m' is warming: unload it once it is ready"):
            await svc.unload("m")
        HeldWarmUp.release.set()
        await asyncio.wait_for(load, 60)
        assert rt.state == ModelState.READY and rt.backend is not None and rt.queue is not None
        await svc.unload("m")  # once ready, it unloads
        assert rt.state == ModelState.UNLOADED and rt.backend is None

    asyncio.run(scenario())
