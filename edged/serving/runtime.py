"""A configured model's runtime: its state and reason, what serves it (backend, entry, queue)
and what was measured of it; the record every part of the daemon reads and the status shows."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from edged.backends.base import Backend, TensorSpec
from edged.cache.store import Entry
from edged.config import ModelConfig
from edged.quantize.job import BuildJob
from edged.serving.admission import PlanItem
from edged.serving.batchfit import BatchFit
from edged.serving.scheduler import ModelQueue
from edged.serving.states import ModelState


@dataclass
class ModelRuntime:
    name: str
    cfg: ModelConfig
    state: ModelState = ModelState.PENDING
    reason: str = ""
    backend_cls: type[Backend] | None = None
    backend_reason: str = ""
    precision: str = ""
    precision_reason: str = ""
    job: BuildJob | None = None
    entry: Entry | None = None
    backend: Backend | None = None
    queue: ModelQueue | None = None
    footprint: int = 0
    measured: bool = False
    infer_us: float | None = None
    threads: int = 0  # intra-op threads per instance, as configured or measured at warm-up
    batching: BatchFit | None = None  # whether batches form, measured at warm-up
    last_used: float = field(default_factory=time.monotonic)
    gate: dict[str, Any] | None = None
    # precision = "auto": every candidate's figures, the choice and why (the choice's manifest).
    auto: dict[str, Any] | None = None
    loading: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Set on a stand-in that serves while the real engine builds: what it stands in for
    # ("tensorrt int8"); its entry is then not a cache entry and is never rewritten.
    stands_in_for: str = ""
    # How the model file stores its weights, when it says (a GGUF's file type): shown as its
    # precision in status, where the build's precision (fp32 for a GGUF) would mislead.
    stored_precision: str = ""
    # The backend this model waits for, whose library is not importable yet (its reason is in
    # backend_reason): the model is then ``waiting`` and has no backend class, job or entry.
    waits_for: str = ""

    @property
    def serving_on(self) -> str:
        return f"{self.backend_cls.name if self.backend_cls else '?'} {self.precision}"

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        return self.backend.inputs if self.backend else ()

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return self.backend.outputs if self.backend else ()

    def plan_item(self) -> PlanItem:
        return PlanItem(self.name, self.cfg.priority, self.cfg.preload, self.footprint, self.measured)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "state": self.state,
            "reason": self.reason,
            "backend": self.backend_cls.name if self.backend_cls else (self.waits_for or None),
            "backend_reason": self.backend_reason,
            "precision": self.stored_precision or self.precision,
            "requested_precision": self.cfg.precision,
            "precision_reason": self.precision_reason,
            "priority": self.cfg.priority,
            "preload": self.cfg.preload,
            "instances": self.cfg.instances,
            "footprint_bytes": self.footprint,
            "footprint_measured": self.measured,
            "inline": bool(self.queue and self.queue.inline),
            "infer_us": None if self.infer_us is None else round(self.infer_us, 1),
            "threads": self.threads,
            "queue": self.queue.backlog if self.queue else 0,
            **(self.queue.batch_stats() if self.queue else {"batches": 0, "rows": 0, "batch_waits": 0}),
            "batching": self.batching.to_dict() if self.batching else None,
            "cache_key": self.entry.key if self.entry and not self.stands_in_for else None,
            "gate": self.gate,
            "auto": self.auto,
            # TensorRT's DLA builds: the layers it reported as falling back to the GPU.
            "dla_gpu_fallback": self.entry.manifest.get("dla_gpu_fallback") if self.entry else None,
            "fallback": bool(self.stands_in_for),
        }
