"""Which large answers edged/wire/encode.py encodes on a worker thread: those with values to
serialise or bytes to copy, not those whose outputs go out as views of their arrays or are in
shared memory already. The thread hand-off is recorded, the encoding itself is the real one."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from edged.wire import encode as encoding
from edged.wire.tensors import InferRequest, OutputRequest

FRAME = np.arange(640 * 640, dtype=np.float32).reshape(1, 1, 640, 640)  # 1.6 MB, a detector's map


def encoded(
    monkeypatch: pytest.MonkeyPatch, req: InferRequest, results: dict[str, np.ndarray], written: bool = False
) -> tuple[bytes, bool]:
    offloaded: list[bool] = []
    to_thread = asyncio.to_thread

    async def recorded(fn: Callable[..., Any], /, *args: Any) -> Any:
        offloaded.append(True)
        return await to_thread(fn, *args)

    monkeypatch.setattr(encoding.asyncio, "to_thread", recorded)
    held = bytearray(FRAME.nbytes)

    def shm(region: str, offset: int, size: int) -> memoryview | None:
        return None if written else memoryview(held)[offset : offset + size]

    parts, _ = asyncio.run(encoding.encode_large_async("m", req, results, shm, written))
    return b"".join(bytes(p) for p in parts), bool(offloaded)


def test_a_large_binary_answer_is_encoded_on_the_loop_as_a_view(monkeypatch: pytest.MonkeyPatch) -> None:
    body, offloaded = encoded(monkeypatch, InferRequest("", {}, None, binary_all=True), {"y": FRAME})
    assert not offloaded
    assert body.endswith(FRAME.tobytes())


def test_large_json_values_are_still_serialised_on_a_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    body, offloaded = encoded(monkeypatch, InferRequest("", {}, None), {"y": FRAME[..., :64]})
    assert offloaded
    assert b'"data":[0.0,1.0,' in body


def test_a_non_contiguous_binary_output_is_copied_on_a_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    strided = FRAME[..., ::2]
    body, offloaded = encoded(monkeypatch, InferRequest("", {}, None, binary_all=True), {"y": strided})
    assert offloaded
    assert body.endswith(np.ascontiguousarray(strided).tobytes())


def test_an_output_bound_for_shared_memory_is_copied_on_a_thread_unless_already_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    req = InferRequest("", {}, [OutputRequest("y", False, "r", 0, FRAME.nbytes)])
    _, offloaded = encoded(monkeypatch, req, {"y": FRAME})
    assert offloaded
    body, offloaded = encoded(monkeypatch, req, {"y": FRAME}, written=True)
    assert not offloaded
    assert b'"shared_memory_byte_size":%d' % FRAME.nbytes in body
