"""A request that arrives while the daemon starts (edged/serving/service.py) waits for readiness and
is then served by whatever serves its model at that point: a real registry, a real ONNX Runtime
stand-in registered during the start, as the boot does for a model whose engine builds."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import onnxruntime as ort

from edged.cache.store import EngineCache
from edged.config import from_mapping
from edged.host.memory import probe_meminfo
from edged.quantize.runner import BuildRunner
from edged.serving.admission import plan
from edged.serving.background import stand_in
from edged.serving.metrics import Metrics
from edged.serving.registry import Registry
from edged.serving.service import Service
from edged.serving.states import ModelState
from edged.tools.demo import make_tiny_mlp

X = {"x": np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)}


def test_a_request_sent_during_the_start_is_served_by_the_stand_in_registered_meanwhile(tmp_path: Path) -> None:
    path = make_tiny_mlp(tmp_path / "m.onnx")
    cfg = from_mapping({"models": {"m": {"path": str(path), "warmup": {"iterations": 1}}}}, base=tmp_path)
    reg = Registry(cfg, EngineCache(tmp_path / "cache"), BuildRunner(cfg.build, probe_meminfo), Metrics(), 1 << 30)
    expected = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, X)[0]

    async def main() -> dict[str, np.ndarray]:
        loop = asyncio.get_running_loop()
        svc = Service(reg, reg.metrics, loop, probe_meminfo(), plan([], reg.budget))
        original = reg.models["m"]
        await asyncio.to_thread(reg.resolve, original)
        request = loop.create_task(svc.infer("m", X))
        await asyncio.sleep(0)  # one turn of the loop: the request looks the model up, then waits for readiness
        assert not request.done() and original.state == ModelState.PENDING
        sub = await asyncio.to_thread(stand_in, reg, original)
        assert sub is not None
        reg.models["m"] = sub  # as lifecycle/boot.py registers a stand-in while the engine builds
        await reg.load(sub, loop)
        svc.ready.set()
        return await asyncio.wait_for(request, 30)

    out = asyncio.run(main())
    np.testing.assert_allclose(out["probs"], expected, rtol=1e-5)
