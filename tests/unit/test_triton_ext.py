"""The pure logic behind Triton's extensions: the statistics records, the log threshold, the CUDA
shared memory answers (the routes themselves are tested against a daemon in
tests/integration/test_triton_extensions.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import numpy as np
import orjson
import pytest

from edged.errors import BadRequestError, CudaSharedMemoryNotSupportedError, DeadlineExceededError
from edged.serving.metrics import uncounted
from edged.serving.scheduler import ModelQueue
from edged.serving.stats import ModelStatistics, Statistics
from edged.transports.http import triton as triton_ext
from tests.unit.test_scheduler import FakeInstance


def test_a_record_adds_what_each_stage_reports() -> None:
    rec = ModelStatistics()
    rec.ran(queue_ns=100, infer_ns=1000, rows=2)
    rec.ran(queue_ns=300, infer_ns=1000, rows=3)
    rec.executed(5, input_ns=40, infer_ns=1000, output_ns=7)
    rec.succeeded(received_ns=10, entered_ns=60, now_ns=2010)
    rec.encoded(90)
    rec.failed(received_ns=0, now_ns=25)
    doc = rec.to_dict("m")
    st = doc["inference_stats"]
    assert (doc["name"], doc["version"], doc["inference_count"], doc["execution_count"]) == ("m", "1", 5, 1)
    assert st["queue"] == {"count": 2, "ns": 400} and st["compute_infer"] == {"count": 2, "ns": 2000}
    assert st["compute_input"] == {"count": 1, "ns": 50} and st["compute_output"] == {"count": 1, "ns": 90}
    assert st["success"] == {"count": 1, "ns": 2000 + 90} and st["fail"] == {"count": 1, "ns": 25}
    assert st["cache_hit"] == st["cache_miss"] == {"count": 0, "ns": 0}
    assert doc["last_inference"] > 0
    assert doc["batch_stats"] == [
        {
            "batch_size": 5,
            "compute_input": {"count": 1, "ns": 40},
            "compute_infer": {"count": 1, "ns": 1000},
            "compute_output": {"count": 1, "ns": 7},
        }
    ]


def test_statistics_leave_out_warm_up_and_unknown_models_and_follow_the_config() -> None:
    models = {"a": 1, "b": 2}
    stats = Statistics(lambda: models)
    assert stats.counted("nope") is None
    with uncounted():
        assert stats.counted("a") is None
    rec = stats.counted("a")
    assert rec is not None and stats.counted("a") is rec
    rec.ran(1, 2, 1)
    assert [m["name"] for m in stats.report()["model_stats"]] == ["a", "b"]  # b: zeros until used
    del models["a"]  # a reload removed it: its record goes when the next one is made
    assert stats.counted("b") is not None
    assert stats._records.keys() == {"b"}
    assert [m["name"] for m in stats.report()["model_stats"]] == ["b"]


@pytest.fixture
def edged_logger() -> Iterator[logging.Logger]:
    logger = logging.getLogger("edged")
    before = logger.level
    logger.setLevel(logging.INFO)
    yield logger
    logger.setLevel(before)


def _post(settings: dict[str, object]) -> dict[str, object]:
    return triton_ext.update_log_settings(orjson.dumps(settings))


@pytest.mark.parametrize(
    ("settings", "level"),
    [
        ({}, logging.INFO),
        ({"log_verbose_level": 2}, logging.DEBUG),
        ({"log_warning": False}, logging.ERROR),  # info goes with it
        ({"log_error": False}, logging.CRITICAL),
        ({"log_info": True, "log_verbose_level": 0}, logging.INFO),
        ({"log_file": "", "log_format": "default"}, logging.INFO),
    ],
)
def test_switches_set_one_threshold(edged_logger: logging.Logger, settings: dict[str, object], level: int) -> None:
    after = _post(settings)
    assert edged_logger.level == level
    assert after == triton_ext.log_settings()


def test_turning_a_level_on_turns_the_more_severe_ones_on(edged_logger: logging.Logger) -> None:
    edged_logger.setLevel(logging.CRITICAL)
    assert triton_ext.log_settings()["log_error"] is False
    after = _post({"log_info": True})
    assert (after["log_error"], after["log_warning"], after["log_info"], after["log_verbose_level"]) == (
        True,
        True,
        True,
        0,
    )


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"not json", "malformed JSON"),
        (b"[]", "must be a JSON object"),
        (b'{"log_level": 1}', "unknown log settings ['log_level']"),
        (b'{"log_info": 1}', "'log_info' must be true or false"),
        (b'{"log_verbose_level": -1}', "non-negative integer"),
        (b'{"log_verbose_level": 1, "log_info": false}', "cannot be combined"),
        (b'{"log_format": "ISO8601"}', "'log_format' cannot be changed"),
        (b'{"log_file": "/var/log/x"}', "'log_file' cannot be set"),
    ],
)
def test_bad_log_settings_are_refused_and_change_nothing(
    edged_logger: logging.Logger, body: bytes, message: str
) -> None:
    with pytest.raises(BadRequestError) as e:
        triton_ext.update_log_settings(body)
    assert message in e.value.message
    assert edged_logger.level == logging.INFO


def test_cuda_shared_memory_status_and_cleanup_answer_and_the_rest_explains() -> None:
    assert triton_ext.cuda_shared_memory(["status"]) == b"[]"
    assert triton_ext.cuda_shared_memory(["unregister"]) == b"{}"
    assert triton_ext.cuda_shared_memory(["region", "r", "unregister"]) == b"{}"
    for rest in (["region", "r", "register"], ["region", "r", "status"]):
        with pytest.raises(CudaSharedMemoryNotSupportedError, match="system shared memory"):
            triton_ext.cuda_shared_memory(rest)
    assert triton_ext.methods(["logging"]) == ("GET", "POST")
    assert triton_ext.methods(["cudasharedmemory", "region", "r", "register"]) == ("POST",)
    assert triton_ext.methods(["cudasharedmemory", "nothing"]) == ()


def test_the_scheduler_times_queue_and_run_and_forgets_abandoned_requests() -> None:
    """With the scheduler tests' fake instance (doubles its input; a gate holds it): a request
    whose caller gave up while it ran is a failure for the statistics, not a run to count."""
    inst = FakeInstance()
    rec = ModelStatistics()

    async def main() -> None:
        q = ModelQueue("m", [inst], asyncio.get_running_loop(), depth=8, max_batch=4, batchable=True)
        q.start()
        inst.gate.clear()
        given_up = asyncio.ensure_future(q.submit({"x": np.ones((1, 2), np.float32)}, 0.05, stats=rec))
        while q.workers[0].busy_since is None:  # the worker runs it (held by the gate)
            await asyncio.sleep(0.001)
        answered = asyncio.ensure_future(q.submit({"x": np.ones((2, 3), np.float32)}, 10, stats=rec))
        with pytest.raises(DeadlineExceededError):
            await given_up
        inst.gate.set()
        assert (await answered)["y"].shape == (2, 3)
        q.close()

    asyncio.run(main())
    assert len(inst.batches) == 2  # both ran
    assert (rec.queue_count, rec.infer_count, rec.inference_count, rec.execution_count) == (1, 1, 2, 1)
    assert rec.queue_ns > 0 and rec.infer_ns > 0
    assert list(rec.batches) == [2] and rec.batches[2][0] == 1
