"""Per-model inference statistics in the shape of Triton's statistics extension.

Each stage is timed where its work happens, with ``time.perf_counter_ns`` and integer adds on
plain slots (no locks, no allocation per request):

- compute_input: from the request's body having arrived (as Triton: a slow upload is not counted)
  to the service getting its decoded inputs (the body's JSON or binary tensors, copies out of
  shared memory);
- queue: from the scheduler's queue to a worker taking the request (batching's wait included);
- compute_infer: the backend's run (for a batch, every request in it adds the batch's run, as
  Triton counts it);
- compute_output: the transport encoding the outputs (JSON, binary, shared memory writes, those
  the model's worker made right after the run included);
- success / fail: the whole request, from the transport taking it to its answer being encoded;
- batch_stats: per batch size, the model's runs, with joining the requests' inputs into one batch
  and splitting its outputs as that batch's compute_input and compute_output.

The stages of a request count once it succeeds (a request abandoned by its caller while it runs
is a failure, and its run is not counted): queue, compute_input and compute_infer count the same
requests as success; compute_output counts the answers the socket and MQTT encoded.

Only the event loop writes these figures: a worker thread's timings travel with its request and
are added when the loop settles the result. The daemon's own warm-up requests are left out, as
in the metrics (``edged.serving.metrics.uncounted``). There is one record per configured model, so the
structure is bounded by the config.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import Any

from edged.serving.metrics import counted

# Triton's version field for a model of the TOML: edged serves it as version 1.
VERSION = "1"


class ModelStatistics:
    """One model's counters. Written only on the event loop; read by the statistics route."""

    __slots__ = (
        "batches",
        "execution_count",
        "fail_count",
        "fail_ns",
        "infer_count",
        "infer_ns",
        "inference_count",
        "input_count",
        "input_ns",
        "last_ns",
        "output_count",
        "output_ns",
        "queue_count",
        "queue_ns",
        "success_count",
        "success_ns",
    )

    def __init__(self) -> None:
        self.success_count = self.success_ns = self.fail_count = self.fail_ns = 0
        self.queue_count = self.queue_ns = self.input_count = self.input_ns = 0
        self.infer_count = self.infer_ns = self.output_count = self.output_ns = 0
        self.inference_count = self.execution_count = 0
        self.last_ns = 0  # perf_counter_ns of the last request's end (0: none yet)
        # Batch size -> [executions, input ns, infer ns, output ns]; at most max_batch keys.
        self.batches: dict[int, list[int]] = {}

    # --- the scheduler (on the loop, once the result is handed back) ---

    def ran(self, queue_ns: int, infer_ns: int, rows: int) -> None:
        """One request's share of a successful execution: its wait and the run it was part of."""
        self.queue_count += 1
        self.queue_ns += queue_ns
        self.infer_count += 1
        self.infer_ns += infer_ns
        self.inference_count += rows

    def ran_alone(self, infer_ns: int, rows: int = 1) -> None:
        """A request run on the event loop: no wait, a batch of its own ``rows`` (ran + executed,
        in one call)."""
        self.queue_count += 1
        self.infer_count += 1
        self.infer_ns += infer_ns
        self.inference_count += rows
        self.execution_count += 1
        entry = self.batches.get(rows)
        if entry is None:
            entry = self.batches[rows] = [0, 0, 0, 0]
        entry[0] += 1
        entry[2] += infer_ns

    def executed(self, batch_size: int, input_ns: int, infer_ns: int, output_ns: int) -> None:
        """One successful run of the model on ``batch_size`` rows (the batch's own copies in and out)."""
        self.execution_count += 1
        entry = self.batches.get(batch_size)
        if entry is None:
            entry = self.batches[batch_size] = [0, 0, 0, 0]
        entry[0] += 1
        entry[1] += input_ns
        entry[2] += infer_ns
        entry[3] += output_ns

    # --- the service and the transports ---

    def succeeded(self, received_ns: int, entered_ns: int, now_ns: int) -> None:
        """The model answered: the request so far (its decoding included) is a success."""
        self.success_count += 1
        self.success_ns += now_ns - received_ns
        self.input_count += 1
        self.input_ns += entered_ns - received_ns
        self.last_ns = now_ns

    def failed(self, received_ns: int, now_ns: int) -> None:
        self.fail_count += 1
        self.fail_ns += now_ns - received_ns
        self.last_ns = now_ns

    def encode_failed(self, received_ns: int, ran_ns: int, now_ns: int) -> None:
        """The model answered (``succeeded``, at about ``ran_ns``) but the answer could not be
        encoded or written (an output region too small or shrunk, text that is not UTF-8): the
        client got an error, so the request is a failure after all."""
        self.success_count -= 1
        self.success_ns -= ran_ns - received_ns
        self.fail_count += 1
        self.fail_ns += now_ns - received_ns
        self.last_ns = now_ns

    def encoded(self, ns: int, written_ns: int = 0) -> None:
        """The answer of a successful request was encoded: its output stage, and its total.
        ``written_ns``: outputs the model's worker wrote into shared memory before the loop had
        the results (in the total already, as the time up to ``succeeded``)."""
        self.output_count += 1
        self.output_ns += ns + written_ns
        self.success_ns += ns

    # --- the wire shape ---

    def to_dict(self, name: str, version: str = VERSION) -> dict[str, Any]:
        def stat(count: int, ns: int) -> dict[str, int]:
            return {"count": count, "ns": ns}

        batches = dict(self.batches)  # the loop may add a batch size meanwhile (a copy is atomic)
        # The request path keeps the monotonic clock (one call fewer per request); the wall
        # clock's offset from it turns that into Triton's milliseconds since the epoch.
        last = (_wall_offset_ns() + self.last_ns) // 1_000_000 if self.last_ns else 0
        return {
            "name": name,
            "version": version,
            "last_inference": last,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                "success": stat(self.success_count, self.success_ns),
                "fail": stat(self.fail_count, self.fail_ns),
                "queue": stat(self.queue_count, self.queue_ns),
                "compute_input": stat(self.input_count, self.input_ns),
                "compute_infer": stat(self.infer_count, self.infer_ns),
                "compute_output": stat(self.output_count, self.output_ns),
                # edged has no response cache: never a hit, never a miss.
                "cache_hit": stat(0, 0),
                "cache_miss": stat(0, 0),
            },
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": stat(n, input_ns),
                    "compute_infer": stat(n, infer_ns),
                    "compute_output": stat(n, output_ns),
                }
                for size, (n, input_ns, infer_ns, output_ns) in sorted(batches.items())
            ],
        }


# The wall clock's offset from perf_counter_ns, taken again at most this often: read afresh for
# every report, two reads of the same record could differ by a millisecond of rounding.
_OFFSET_EVERY_NS = 60 * 1_000_000_000
_offset: list[int] = []  # [offset, when it was taken (perf_counter_ns)]


def _wall_offset_ns() -> int:
    now = time.perf_counter_ns()
    if not _offset or now - _offset[1] > _OFFSET_EVERY_NS:
        _offset[:] = [time.time_ns() - time.perf_counter_ns(), now]
    return _offset[0]


class Statistics:
    """The records of the configured models, created on first use and dropped when a reload
    removes the model (``models`` is read live from the registry)."""

    def __init__(
        self,
        models: Callable[[], Collection[str]],
        served: Callable[[str], tuple[str, str]] = lambda name: (name, VERSION),
    ) -> None:
        self._models = models
        self._served = served  # the model and version a registered name serves (a repository's versions)
        self._records: dict[str, ModelStatistics] = {}

    def counted(self, name: str) -> ModelStatistics | None:
        """The record to add a request to; None for the daemon's warm-up or an unknown model."""
        rec = self._records.get(name)
        if rec is None:
            if name not in self._models():
                return None
            rec = self._add(name)
        return rec if counted() else None

    def encoded(self, name: str, ran_ns: int, written_ns: int = 0) -> None:
        """A transport finished encoding a successful answer that the model produced at ``ran_ns``
        (``written_ns``: ModelStatistics.encoded)."""
        rec = self._records.get(name)
        if rec is not None and counted():
            rec.encoded(time.perf_counter_ns() - ran_ns, written_ns)

    def encode_failed(self, name: str, received_ns: int, ran_ns: int) -> None:
        rec = self._records.get(name)
        if rec is not None and counted():
            rec.encode_failed(received_ns, ran_ns, time.perf_counter_ns())

    def _add(self, name: str) -> ModelStatistics:
        known = self._models()
        for gone in [n for n in self._records if n not in known]:  # a reload removed it
            del self._records[gone]
        rec = self._records[name] = ModelStatistics()
        return rec

    def report(self, name: str | None = None) -> dict[str, Any]:
        """``{"model_stats": [...]}`` for one model or every configured one (zeros until used)."""
        names = [name] if name is not None else sorted(self._models())
        stats = [(self._records.get(n) or ModelStatistics()).to_dict(*self._served(n)) for n in names]
        return {"model_stats": stats}
