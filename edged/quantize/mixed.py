"""The mixed-precision step of a build: the all-INT8 artefact failed its gate, so search for nodes
to keep in float (:mod:`edged.quantize.search`), each trial built and judged as the final artefact is.

The passing trial's artefact replaces the all-INT8 one at the build's temporary path, so the
pipeline commits it as usual; its manifest carries the exclusion list, every trial's figures and
the share of the compute left in INT8. When no trial passes within ``max_trials`` the all-INT8
verdict stands with the search recorded, and the pipeline falls back a precision, saying so.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edged.backends.base import Backend, Progress
from edged.cache.store import EngineCache
from edged.config import GateConfig
from edged.quantize.job import FLOAT_NODES_OPTION, BuildJob

log = logging.getLogger(__name__)

RANK_SAMPLES = 4  # calibration samples the sensitivity ranking runs (two models, every tensor)


# (Q/DQ model, artefact path, nodes kept in float) -> (build summary, gate figures): the
# pipeline's own build and gate, handed in so that this module needs nothing of the pipeline.
BuildAndJudge = Callable[[Path, Path, list[str]], tuple[dict[str, Any], dict[str, Any]]]


@dataclass
class Found:
    gate: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)


def mixed_precision(
    job: BuildJob,
    cls: type[Backend],
    cache: EngineCache,
    calib: Any,
    first: dict[str, Any],
    tmp: Path,
    progress: Progress,
    all_int8: Path,
    build_and_judge: BuildAndJudge,
) -> Found:
    """The search, or the all-INT8 verdict with the reason when the search itself fails (a model
    the ranking cannot run, a trial the quantizer refuses): INT8 then falls back a precision."""
    try:
        return _search(job, cls, cache, calib, first, tmp, progress, all_int8, build_and_judge)
    except Exception as e:  # a failed search must not cost the model its fallback
        why = f"{type(e).__name__}: {e}"
        log.warning("%s: mixed-precision search failed: %s", job.model, why, extra={"model": job.model})
        gate = dict(first, reason=f"{first['reason']}; mixed precision: search failed ({why})")
        return Found(gate, {"mixed_precision": {"passed": False, "error": why}})


def _search(
    job: BuildJob,
    cls: type[Backend],
    cache: EngineCache,
    calib: Any,
    first: dict[str, Any],
    tmp: Path,
    progress: Progress,
    all_int8: Path,
    build_and_judge: BuildAndJudge,
) -> Found:
    from edged.quantize import search
    from edged.quantize.qdq import prepare

    cfg = GateConfig(**job.gate)
    assert job.calibration is not None
    method = str(job.calibration.get("method", "minmax"))
    percentile = float(job.calibration.get("percentile", 99.999))
    ranges = all_int8.with_suffix(".ranges.json")
    log.info(
        "%s: all-INT8 failed its gate; searching for nodes to keep in float", job.model, extra={"model": job.model}
    )
    progress("ranking nodes", None)
    with tempfile.TemporaryDirectory(prefix=f".tmp-{os.getpid()}-mixed-", dir=cache.dir) as workdir:
        work = Path(workdir)
        feeds = [f for _, f in zip(range(RANK_SAMPLES), calib)]
        infos = search.rank(prepare(Path(job.source), work), all_int8, feeds)
        if not infos:
            gate = dict(first, reason=f"{first['reason']}; mixed precision: no weighted node to keep in float")
            return Found(gate, {"mixed_precision": {"passed": False, "trials": []}})
        best: dict[str, Any] = {}
        trial = _trial(job, cls, calib, method, percentile, ranges, work, progress, build_and_judge, best)
        result = search.search(infos, trial, cfg.max_trials, first)
        record = result.to_dict()
        if not result.passed or result.gate is None:
            gate = dict(first, search=record)
            gate["reason"] = f"{first['reason']}; mixed precision: no trial of {len(result.trials)} passed"
            return Found(gate, {"mixed_precision": record})
        os.replace(best["artefact"], tmp)
        kept = cache.dir / "qdq" / f"{job.model}-{all_int8.stem.split('-')[-1]}-mixed.onnx"
        os.replace(best["qdq"], kept)
    gate = dict(result.gate, search=record)
    log.info(
        "%s: mixed precision passes with %d of %d weighted nodes in float (%.1f%% of MACs in INT8) after %d trials",
        job.model,
        len(result.excluded),
        len(infos),
        100 * result.int8_mac_fraction,
        len(result.trials),
        extra={"model": job.model},
    )
    extra = dict(best["extra"], qdq_model=kept.name, mixed_precision=record)
    extra[FLOAT_NODES_OPTION] = result.excluded
    return Found(gate, extra)


def _trial(
    job: BuildJob,
    cls: type[Backend],
    calib: Any,
    method: str,
    percentile: float,
    ranges: Path,
    work: Path,
    progress: Progress,
    build_and_judge: BuildAndJudge,
    best: dict[str, Any],
) -> Callable[[list[str]], dict[str, Any]]:
    """The search's trial: a Q/DQ model with the given nodes kept in float, written under
    ``work``, built and judged; it returns the gate's figures and records a passing trial's files
    and build summary in ``best``."""
    from edged.quantize.qdq import quantize_qdq

    def trial(excluded: list[str]) -> dict[str, Any]:
        progress(f"mixed precision: {len(excluded)} nodes in float", None)
        tag = hashlib.sha256("\0".join(sorted(excluded)).encode()).hexdigest()[:12]
        qdq = work / f"mixed-{tag}.onnx"
        summary = quantize_qdq(
            Path(job.source),
            qdq,
            calib,
            method,
            percentile,
            ranges,
            nodes_to_exclude=excluded,
            model_digest=job.source_digest,
        )
        artefact = work / f"artefact-{tag}{cls.artifact_suffix}"
        built, gate = build_and_judge(qdq, artefact, excluded)
        if gate["passed"]:  # the search tries fewer nodes only after a pass: the last pass is the best
            best.update(excluded=excluded, qdq=qdq, artefact=artefact, extra=dict(summary, **built))
        return gate

    return trial
