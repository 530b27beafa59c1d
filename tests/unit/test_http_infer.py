"""The infer route's own logic: which paths take its shortcut, and a request whose model changes
while its body is decoded off the loop (a real ONNX Runtime model, a real registry)."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from edged.cache.store import EngineCache
from edged.config import from_mapping
from edged.errors import InvalidInputError
from edged.host.memory import probe_meminfo
from edged.quantize.runner import BuildRunner
from edged.serving.admission import plan
from edged.serving.background import stand_in
from edged.serving.metrics import Metrics
from edged.serving.registry import ModelRuntime, Registry
from edged.serving.service import Service, decode_now
from edged.serving.states import ModelState
from edged.tools.demo import make_tiny_mlp
from edged.transports.http.infer import InferRoute, infer_target
from edged.transports.shm.regions import SharedMemoryRegistry
from edged.wire.decode import OFFLOAD_BYTES, InferRequest
from edged.wire.validate import InputRules
from tests.helpers import FREEZE_S


def test_infer_target_takes_only_the_plain_infer_path() -> None:
    assert infer_target("/v2/models/tiny/infer") == "tiny"
    assert infer_target("/v2/models/a.b-c_1/infer") == "a.b-c_1"
    # Routed in full (they reach the same route, or the right error, that way)
    for path in (
        "/v2/models//infer",
        "/v2/models/tiny/versions/1/infer",
        "/v2/models/tiny/infer/",
        "//v2/models/tiny/infer",
        "/v2/models/tiny/ready",
        "/v2/models/infer",
        "/v1/models/tiny/infer",
    ):
        assert infer_target(path) is None, path


def inline_service(
    tmp_path: Path, loop: asyncio.AbstractEventLoop, **server: Any
) -> tuple[Registry, Service, ModelRuntime]:
    """A real registry and service around the demo's tiny MLP (model "m"), left UNLOADED (load it
    to serve); ``server``: more of the server table."""
    make_tiny_mlp(tmp_path / "m.onnx")
    raw = {
        # Inline whatever the warm-up measures on a loaded machine: the case under test
        "server": {"inline_threshold_us": 10**7, **server},
        "models": {"m": {"path": str(tmp_path / "m.onnx"), "warmup": {"iterations": 1}}},
    }
    cfg = from_mapping(raw, base=tmp_path)
    reg = Registry(cfg, EngineCache(tmp_path / "cache"), BuildRunner(cfg.build, probe_meminfo), Metrics(), 1 << 30)
    resolved = ModelRuntime("m", cfg.models["m"])
    reg.resolve(resolved)
    rt = stand_in(reg, resolved)
    assert rt is not None
    reg.models["m"] = rt
    reg.set_state(rt, ModelState.UNLOADED, "a test")
    svc = Service(reg, reg.metrics, loop, probe_meminfo(), plan([], 1 << 30))
    svc.ready.set()
    return reg, svc, rt


def test_a_model_loaded_while_a_large_body_decodes_answers_from_the_loaded_model(tmp_path: Path) -> None:
    """A body over OFFLOAD_BYTES is decoded off the loop: the route's lookup made before that
    await must not be used after it (it held no rules for the then unloaded model: a 500)."""

    async def main() -> tuple[int, Any]:
        loop = asyncio.get_running_loop()
        reg, svc, rt = inline_service(tmp_path, loop)
        decode = svc.decode_infer

        async def decode_then_load(*args: Any, **kwargs: Any) -> InferRequest:
            req = await decode(*args, **kwargs)
            await reg.load(rt, loop)  # another request's lazy load, or POST .../load, finishing meanwhile
            return req

        svc.decode_infer = decode_then_load  # type: ignore[method-assign]
        doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 16], "data": [0.5] * 16}]}
        body = orjson.dumps(doc) + b" " * (OFFLOAD_BYTES + 1)
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            return messages.pop(0)

        scope = {"type": "http", "method": "POST", "path": "/v2/models/m/infer", "headers": []}
        route = InferRoute(svc, SharedMemoryRegistry(), 1 << 26)
        try:
            status, answer, _ = await route("m", scope, receive)
            assert rt.queue is not None and rt.queue.inline  # the case under test: an inline model
        finally:
            if rt.queue is not None:
                rt.queue.close()
        return status, answer

    status, answer = asyncio.run(main())
    assert status == 200
    assert isinstance(answer, bytes) and orjson.loads(answer)["outputs"][0]["shape"] == [1, 4]


def test_infer_now_declines_a_lookup_the_registry_has_moved_past(tmp_path: Path) -> None:
    """What a caller looked up before an await is used only while it is still the model's: a
    plan made before the load (no rules), or a runtime a reload has replaced, gets None (the
    caller then goes by name); the current pair gets the answer, counted once."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        reg, svc, rt = inline_service(tmp_path, loop)
        stale_plan = svc.plan_for(rt)  # made while unloaded
        await reg.load(rt, loop)
        try:
            x = {"x": np.full((1, 16), 0.5, np.float32)}
            assert rt.queue is not None and rt.queue.inline
            assert svc.infer_now(rt, stale_plan, x) is None
            replaced = ModelRuntime("m", rt.cfg)
            reg.models["m"] = replaced  # a reload's new runtime (not loaded here)
            assert svc.infer_now(rt, svc.plan_for(rt), x) is None
            reg.models["m"] = rt
            out = svc.infer_now(rt, svc.plan_for(rt), x)
            assert out is not None and [a.shape for a in out.values()] == [(1, 4)]
            assert svc.metrics.model("m").requests == 1  # the two declines counted nothing
        finally:
            if rt.queue is not None:
                rt.queue.close()

    asyncio.run(main())


def test_a_header_seen_before_has_its_inputs_checked_once_per_model_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests whose inputs the decoder's plan laid out (one header, tensors in the binary part)
    are checked against the model's rules once per model plan; JSON data is checked each time,
    and a wrong shape is refused however often its header was seen."""
    checks: list[int] = []
    check = InputRules.check

    def counted(self: InputRules, inputs: Any) -> None:
        checks.append(1)
        check(self, inputs)

    monkeypatch.setattr(InputRules, "check", counted)

    def binary(x: np.ndarray) -> tuple[bytes, int]:
        head = orjson.dumps(
            {
                "inputs": [
                    {
                        "name": "x",
                        "datatype": "FP32",
                        "shape": list(x.shape),
                        "parameters": {"binary_data_size": x.nbytes},
                    }
                ]
            }
        )
        return head + x.tobytes(), len(head)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        reg, svc, rt = inline_service(tmp_path, loop)
        await reg.load(rt, loop)
        try:
            mplan = svc.plan_for(rt)
            checks.clear()  # the warm-up's
            body, n = binary(np.full((1, 16), 0.5, np.float32))
            for _ in range(3):
                req = decode_now(mplan, body, n, None)
                assert req.shapes is not None and svc.infer_now(rt, mplan, req.inputs, shapes=req.shapes) is not None
            assert len(checks) == 1
            doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 16], "data": [0.5] * 16}]}
            for _ in range(2):
                req = decode_now(mplan, orjson.dumps(doc), None, None)
                assert req.shapes is None and svc.infer_now(rt, mplan, req.inputs, shapes=req.shapes) is not None
            assert len(checks) == 3
            wrong, wrong_n = binary(np.full((1, 15), 0.5, np.float32))
            for _ in range(2):
                req = decode_now(mplan, wrong, wrong_n, None)
                with pytest.raises(InvalidInputError, match="input 'x'"):
                    svc.infer_now(rt, mplan, req.inputs, shapes=req.shapes)
            assert len(checks) == 5
            fresh = replace(mplan, passed={})  # a reload's new model plan remembers nothing
            req = decode_now(fresh, body, n - 0 if False else binary(np.full((1, 16), 0.5, np.float32))[1], None)
            svc._plans["m"] = fresh
            assert svc.infer_now(rt, fresh, req.inputs, shapes=req.shapes) is not None
            assert len(checks) == 6
        finally:
            if rt.queue is not None:
                rt.queue.close()

    asyncio.run(main())


def test_outputs_the_worker_writes_into_shared_memory_count_as_compute_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Written by the model's worker before the loop has the results, they are still the
    answer's output stage in Triton's statistics (not the run's, nor nobody's)."""
    from multiprocessing import shared_memory

    from edged.transports.peer import Peer
    from edged.transports.shm import copies as shm_io

    real = shm_io._write_all

    def slow_write(region: Any, pos: int, buf: np.ndarray) -> None:
        time.sleep(FREEZE_S)  # a write far longer than the tiny model's run: its place in the figures shows
        real(region, pos, buf)

    monkeypatch.setattr(shm_io, "_write_all", slow_write)
    segment = shared_memory.SharedMemory(create=True, size=1 << 17)

    async def main() -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        reg, svc, rt = inline_service(tmp_path, loop, inline_threshold_us=0)  # run on the worker
        await reg.load(rt, loop)
        regions = SharedMemoryRegistry()
        peer = Peer(os.getpid(), os.getuid(), os.getgid())
        regions.register(peer, "out", segment.name, 0, 1 << 17)
        doc = {
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 16], "data": [0.5] * 16}],
            "outputs": [
                {"name": "probs", "parameters": {"shared_memory_region": "out", "shared_memory_byte_size": 70000}}
            ],
        }
        messages = [{"type": "http.request", "body": orjson.dumps(doc), "more_body": False}]

        async def receive() -> dict[str, Any]:
            return messages.pop(0)

        scope = {"type": "http", "method": "POST", "path": "/v2/models/m/infer", "headers": [], "edged.peer": peer}
        route = InferRoute(svc, regions, 1 << 26)
        try:
            status, answer, _ = await route("m", scope, receive)
            assert status == 200, answer
        finally:
            assert rt.queue is not None
            rt.queue.close()
            regions.unregister_for(peer, "out")
        return svc.stats.report("m")["model_stats"][0]["inference_stats"]

    try:
        figures = asyncio.run(main())
        assert segment.buf is not None
        assert np.frombuffer(segment.buf[:16], np.float32).any(), "the answer was not written"
    finally:
        segment.close()
        segment.unlink()
    assert figures["success"]["count"] == 1
    assert figures["compute_output"]["ns"] >= FREEZE_S * 1e9, figures
    assert figures["compute_infer"]["ns"] < FREEZE_S * 1e9, figures  # not counted as the run
