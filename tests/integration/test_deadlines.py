"""Requests that pass their deadline behind a stuck worker, against the real daemon (uvloop):
each is answered 504 deadline_exceeded, never a 500 or a dropped connection.

uvloop keeps its clock in whole milliseconds: a deadline told from that clock can be read as the
caller's own cancellation (for 20-35% of such requests), which would be a 500 from uvicorn with a
logged traceback, and over MQTT no answer and no acknowledgement. The scheduler marks the request
its timer expired (tests/unit/test_scheduler.py has the unit-level cases).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from pathlib import Path

import numpy as np

from edged import errors
from edged.client import Client
from edged.tools.demo import make_tiny_mlp
from tests.helpers import DaemonProcess, wait_for
from tests.integration.mosquitto import Broker, Peer, broker
from tests.integration.mqtt_daemon import Edged, code_of, json_request

__all__ = ["broker"]  # a fixture: imported so that pytest finds it

REQUESTS = 40
TOPIC = "edged/dev-d/models/tiny/infer"
# The test-only fault switch: while the file exists, a worker that takes a request hangs (polled
# by the watchdog loop, which runs when WATCHDOG_USEC is set).
WEDGE_ENV = {"WATCHDOG_USEC": "200000"}


def test_every_request_queued_past_its_deadline_is_answered_504(
    daemon_factory: Callable[..., DaemonProcess], model_dir: Path, tmp_path: Path
) -> None:
    wedge = tmp_path / "wedge"
    d = daemon_factory(
        {"tiny": {"path": str(model_dir / "tiny.onnx"), "backend": "onnxruntime", "timeout_ms": 50}},
        extra={"server": {"inline_threshold_us": 0}, "lifecycle": {"drain_timeout_s": 1.0}},
        env={"EDGED_TEST_WEDGE": str(wedge), **WEDGE_ENV},
    ).start()
    x = np.ones((1, 16), np.float32)
    outcomes: collections.Counter[str] = collections.Counter()
    try:
        with Client(str(d.socket)) as c:
            wedge.touch()

            def wedged() -> bool:
                try:
                    c.infer("tiny", {"x": x})
                except errors.DeadlineExceededError:
                    return True
                return False

            wait_for(wedged, 20, interval=0, what="the worker to hang")
            for _ in range(REQUESTS):
                try:
                    c.infer("tiny", {"x": x})
                    outcomes["answered"] += 1
                except errors.DeadlineExceededError:
                    outcomes["504"] += 1
                except Exception as e:  # anything else: a 500, or a closed connection
                    outcomes[f"{type(e).__name__}: {str(e)[:80]}"] += 1
    finally:
        wedge.unlink(missing_ok=True)
    assert outcomes == {"504": REQUESTS}, dict(outcomes)
    assert "Exception in ASGI application" not in d.log()


def test_every_mqtt_request_queued_past_its_deadline_is_answered(
    broker: Broker, tmp_path: Path, daemons: list[Edged]
) -> None:
    """Over MQTT a deadline read as a cancellation would leave the request unanswered and
    unacknowledged (acknowledgements go out in arrival order: every later one would wait behind
    it)."""
    wedge = tmp_path / "wedge"
    tiny = {"tiny": {"path": str(make_tiny_mlp(tmp_path / "tiny.onnx")), "timeout_ms": 50}}
    d = Edged(
        tmp_path / "edge",
        broker.port,
        "dev-d",
        tiny,
        tmp_path / "cache",
        extra={"server": {"inline_threshold_us": 0}, "lifecycle": {"drain_timeout_s": 1.0}},
        env={"EDGED_TEST_WEDGE": str(wedge), **WEDGE_ENV},
    )
    d.start()
    daemons.append(d)
    x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)
    codes: collections.Counter[str] = collections.Counter()
    try:
        with Peer(broker.port) as p:
            p.subscribe("reply/d")
            wedge.touch()
            sent = 0

            def answer() -> str:
                """Send one request and wait for its answer; its code."""
                nonlocal sent
                rid = f"r{sent}".encode()
                sent += 1
                p.request(TOPIC, json_request(x, rid.decode()), "reply/d", rid)
                wait_for(lambda: any(r.correlation == rid for r in p.on("reply/d")), 10, what=f"an answer to {rid!r}")
                return code_of(next(r for r in p.on("reply/d") if r.correlation == rid))

            wait_for(lambda: answer() == "deadline_exceeded", 20, interval=0, what="the worker to hang")
            for _ in range(REQUESTS):
                codes[answer()] += 1
    finally:
        wedge.unlink(missing_ok=True)
    assert codes == {"deadline_exceeded": REQUESTS}, dict(codes)
