"""``precision = "auto"`` in the build child: build and judge every candidate, time the ones that
pass, record the choice.

The candidates are the precisions the backend can build for this model here
(``Backend.buildable_precisions``: int8, with its mixed-precision search, fp16 where there is
one, and fp32, the reference). Each is built and judged exactly as an explicit build of that
precision is, under that precision's own key, so an explicit build finds it in the cache and an
auto build finds what an explicit one made. The ones that pass are loaded side by side and timed
(edged/quantize/timing.py) at the warm-up shapes, and edged/quantize/choice.py picks one.

The choice is a cache entry of its own, without an artefact: its key holds precision ``auto``
(so it never collides with an explicit entry), the device fingerprint, the calibration, the gate,
the timing settings and the rule's version, and its manifest holds every candidate's figures,
the choice and why. A restart reads it and times nothing; another device, backend version or
setting has another key and chooses again.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from edged.backends.base import Backend, LoadOptions, Progress
from edged.backends.warm_inputs import warm_inputs
from edged.cache.store import EngineCache, Entry
from edged.config import ModelConfig
from edged.errors import BuildError
from edged.quantize.choice import MARGIN, ORDER, Candidate, choose
from edged.quantize.figures import describe, precision_text
from edged.quantize.job import BuildJob, job_key, key_fields
from edged.quantize.pipeline import build_one, build_precision
from edged.quantize.timing import Timing, time_alternating

log = logging.getLogger(__name__)


def build_auto(job: BuildJob, cls: type[Backend], cache: EngineCache, progress: Progress) -> Entry:
    """The entry of the precision ``auto`` chose for ``job``, choosing first unless the cache
    holds the choice already (then only a missing chosen artefact is built again)."""
    key = job_key(job, cls)
    with cache.lock(job.model, key):
        record = cache.lookup(job.model, key, cls.artifact_suffix)
        if record is None or not (record.manifest.get("auto") or {}).get("choice"):
            record = _choose_locked(job, cls, cache, key, progress)
    chosen = str(record.manifest["auto"]["choice"]["precision"])
    return build_precision(job.at_precision(chosen), cls, cache, progress)


def _choose_locked(job: BuildJob, cls: type[Backend], cache: EngineCache, key: str, progress: Progress) -> Entry:
    started = time.monotonic()
    buildable = cls.buildable_precisions(job.source, job.options)
    precisions = [p for p in ORDER if p in buildable or p == "fp32"]
    built: dict[str, Entry] = {}
    figures: dict[str, dict[str, Any]] = {}
    for precision in reversed(precisions):  # int8 first: the longest build, the likeliest winner
        entry, figures[precision] = _candidate(job.at_precision(precision), cls, cache, progress)
        if entry is not None:
            built[precision] = entry
    if "fp32" not in built:
        raise BuildError(f"{job.model}: auto: the fp32 candidate did not build: {figures['fp32']['note']}")
    progress("auto: timing the candidates", None)
    for precision, timing in _time(job, cls, built).items():
        figures[precision].update(timing.to_dict())
    candidates = [
        Candidate(p, f["label"], f["passed"], f.get("median_ms"), f.get("note", "")) for p, f in figures.items()
    ]
    choice = choose(candidates, MARGIN)
    assert choice is not None  # fp32 built, passed (it is the reference) and was timed
    log.info("%s: auto chose %s", job.model, choice.why, extra={"model": job.model})
    auto = {
        "candidates": [figures[p] for p in precisions],
        "choice": {"precision": choice.precision, "label": choice.label, "why": choice.why},
        "margin": MARGIN,
        "seconds": round(time.monotonic() - started, 3),
    }
    manifest = {
        "key_fields": key_fields(job, cls),
        "backend": cls.name,
        "precision": "auto",
        "source": job.source,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "auto": auto,
        "build_seconds": auto["seconds"],
    }
    return cache.commit(job.model, key, cls.artifact_suffix, None, manifest)


def _candidate(
    job: BuildJob, cls: type[Backend], cache: EngineCache, progress: Progress
) -> tuple[Entry | None, dict[str, Any]]:
    """One precision built and judged as an explicit build of it would be: (its entry when it
    passed, its figures)."""
    progress(f"auto: building {job.precision}", None)
    figures: dict[str, Any] = {"precision": job.precision, "label": job.precision, "key": job_key(job, cls)}
    try:
        entry = build_one(job, cls, cache, progress)
    except Exception as e:  # a candidate that does not build is not served; fp32's failure is the build's
        log.warning("%s: auto: %s did not build: %s", job.model, job.precision, e, extra={"model": job.model})
        return None, dict(figures, passed=False, note=f"did not build ({e.__class__.__name__}: {e})")
    gate = entry.manifest.get("gate")
    figures["label"] = precision_text(job.precision, gate)
    figures["gate"] = describe(gate) if gate else None
    if entry.manifest.get("artifact") is None:  # the gate rejected it
        reason = (gate or {}).get("reason", "")
        return None, dict(figures, passed=False, note=f"failed the accuracy gate ({reason})")
    return entry, dict(figures, passed=True)


def _time(job: BuildJob, cls: type[Backend], built: dict[str, Entry]) -> dict[str, Timing]:
    """Every built candidate loaded at once, as it serves (its threads, one instance), and timed
    at the warm-up shapes in alternating blocks."""
    timing = job.timing
    model = msgspec.convert(
        {
            "path": job.source,
            "warmup": timing.get("warmup") or {},
            "profiles": {k: {"min": v[0], "opt": v[1], "max": v[2]} for k, v in job.profiles.items()},
        },
        ModelConfig,
    )
    opts = LoadOptions(
        threads=int(timing.get("threads", 0)), instances=int(timing.get("instances", 1)), options=job.options
    )
    backends: list[Backend] = []
    runs: dict[str, Callable[[], object]] = {}
    try:
        for precision, entry in built.items():
            backend = cls(entry.artifact, opts)
            backends.append(backend)
            backend.load()
            inst = backend.instance()
            runs[precision] = functools.partial(inst.infer, warm_inputs(backend.inputs, model))
        return time_alternating(runs)
    finally:
        for backend in backends:
            backend.unload()
