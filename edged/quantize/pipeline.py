"""The precision pipeline inside the build child: calibrate → Q/DQ model → engine → accuracy gate,
and the fallback through the precisions a backend supports when the gate says no.

Every build at a reduced precision is judged against the FP32 model run by ONNX Runtime (the
reference) on held-out samples. A precision that fails is recorded in the cache under its own key
(no artefact: the measured figures, the reason, and the precision to use instead), so the next boot
goes straight to the fallback without building or judging again, and no user ever gets a silently
degraded model.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edged.backends.base import Backend, BuildSpec, LoadOptions, Progress, TensorSpec
from edged.cache.store import EngineCache, Entry
from edged.config import CalibrationConfig, GateConfig
from edged.errors import BuildError
from edged.quantize.job import FLOAT_NODES_OPTION, PIPELINE_RECIPE, BuildJob, job_key, key_fields

if TYPE_CHECKING:
    from edged.quantize.mixed import Found

log = logging.getLogger(__name__)

Feed = dict[str, np.ndarray]
RunFn = Callable[[Feed], Mapping[str, np.ndarray]]


LADDER = ("int8", "fp16", "fp32")


def fallback_precision(cls: type[Backend], job: BuildJob) -> str | None:
    """The next precision down the ladder int8 → fp16 → fp32 that this backend can build for
    this model here (``Backend.buildable_precisions``: TensorRT 11 builds no fp16 from an FP32
    model, so its int8 falls back to fp32)."""
    buildable = cls.buildable_precisions(job.source, job.options)
    for candidate in LADDER[LADDER.index(job.precision) + 1 :]:
        if candidate in buildable:
            return candidate
    return None


def _reference(source: str) -> tuple[RunFn, tuple[TensorSpec, ...]]:
    """The FP32 model on ONNX Runtime: the reference every reduced precision is judged against."""
    from edged.backends.onnxruntime import OnnxRuntimeBackend, ort_session

    sess = ort_session(source)
    specs = OnnxRuntimeBackend.specs_of(sess)
    names = [o.name for o in sess.get_outputs()]
    return (lambda feed: dict(zip(names, sess.run(names, feed)))), specs


def _candidate(cls: type[Backend], artifact: Path, options: Mapping[str, Any]) -> tuple[RunFn, Backend]:
    backend = cls(artifact, LoadOptions(instances=1, options=options))
    backend.load()
    inst = backend.instance()
    return inst.infer, backend


def _samples(job: BuildJob, specs: tuple[TensorSpec, ...]) -> tuple[Any, Any]:
    from edged.quantize.calibrate import CalibrationSet

    assert job.calibration is not None
    cfg = CalibrationConfig(**job.calibration)
    samples = CalibrationSet.load(cfg, specs)
    return samples.split(float(job.gate.get("holdout", 0.2)))


def _qdq_model(job: BuildJob, cache: EngineCache, calib: Any, progress: Progress) -> tuple[Path, dict[str, Any]]:
    """The Q/DQ model, shared by every backend built from the same model, data and method."""
    from edged.quantize.qdq import quantize_qdq, ranges_key

    assert job.calibration is not None
    method = str(job.calibration.get("method", "minmax"))
    percentile = float(job.calibration.get("percentile", 99.999))
    # The pipeline's recipe names the file too: a changed recipe writes a new Q/DQ model.
    key = hashlib.sha256(
        f"{ranges_key(job.source_digest, calib.digest, method, percentile)}:{PIPELINE_RECIPE}".encode()
    ).hexdigest()
    qdq_dir = cache.dir / "qdq"
    out = qdq_dir / f"{job.model}-{key[:20]}.onnx"
    ranges = qdq_dir / f"{job.model}-{key[:20]}.ranges.json"
    if out.exists():
        return out, {"qdq_model": out.name, "ranges": "cached", "method": method}
    summary = quantize_qdq(
        Path(job.source), out, calib, method, percentile, ranges, progress=progress, model_digest=job.source_digest
    )
    return out, dict(summary, qdq_model=out.name)


def _gate(
    job: BuildJob, cls: type[Backend], artifact: Path, held: Any, reference: RunFn, progress: Progress
) -> dict[str, Any]:
    from edged.quantize.gate import evaluate

    progress("accuracy gate", None)
    candidate, backend = _candidate(cls, artifact, job.options)
    try:
        gate_cfg = GateConfig(**job.gate)
        return evaluate(reference, candidate, held, gate_cfg).to_dict()
    finally:
        backend.unload()


def _build_artifact(
    job: BuildJob,
    cls: type[Backend],
    source: str,
    tmp: Path,
    progress: Progress,
    float_nodes: Sequence[str] = (),
    calibration: Any = None,
) -> dict[str, Any]:
    options = dict(job.options)
    if float_nodes:
        # The nodes a mixed-precision search kept out of INT8 (names of the Q/DQ model's nodes):
        # ONNX Runtime runs them FP32 as written; TensorRT may run them FP16.
        options[FLOAT_NODES_OPTION] = list(float_nodes)
    spec = BuildSpec(
        source=source,
        precision=job.precision,
        profiles={k: (tuple(v[0]), tuple(v[1]), tuple(v[2])) for k, v in job.profiles.items()},
        options=options,
        calibration=calibration,
        cache_dir=job.cache_dir,  # every build and every search trial shares what the device learnt
    )
    return cls.build(spec, tmp, progress)


def build_one(job: BuildJob, cls: type[Backend], cache: EngineCache, progress: Progress) -> Entry:
    """The entry of ``job``'s key, built and judged at its precision unless another process has;
    an entry without an artefact is a precision its gate rejected (the manifest says why)."""
    key = job_key(job, cls)
    with cache.lock(job.model, key):
        existing = cache.lookup(job.model, key, cls.artifact_suffix)
        if existing is None:
            existing = _build_locked(job, cls, cache, key, progress)
    return existing


def build_precision(job: BuildJob, cls: type[Backend], cache: EngineCache, progress: Progress) -> Entry:
    """Build ``job`` at its precision (unless another process has), judging reduced precisions;
    on a failed gate record why and build the fallback instead. Returns the entry to serve."""
    existing = build_one(job, cls, cache, progress)
    fallback = existing.manifest.get("fallback")
    if existing.manifest.get("artifact") is None and fallback:
        try:
            return build_precision(job.at_precision(str(fallback)), cls, cache, progress)
        except BuildError as e:  # name the step: the reduced precision's verdict stands
            verdict = (existing.manifest.get("gate") or {}).get("reason", "")
            raise BuildError(
                f"{job.model}: {job.precision} failed its accuracy gate ({verdict}), so {fallback} was to be "
                f"served, but building {fallback} failed: {e}"
            ) from e
    return existing


def _build_locked(job: BuildJob, cls: type[Backend], cache: EngineCache, key: str, progress: Progress) -> Entry:
    started = time.monotonic()
    reduced = job.precision != "fp32" and job.calibration is not None
    source, held, reference, calib, legacy = job.source, None, None, None, None
    extra: dict[str, Any] = {}
    if reduced:
        reference, specs = _reference(job.source)  # one FP32 session: input specs, then the gate
        calib, held = _samples(job, specs)
        if job.precision == "int8" and job.options.get("legacy_calibrator"):
            legacy = calib  # TensorRT <= 10's implicit calibrator takes the FP32 model and samples
        elif job.precision == "int8":
            progress("calibrating", None)
            qdq, extra = _qdq_model(job, cache, calib, progress)
            source = str(qdq)
    tmp = cache.temp_path(cls.artifact_suffix)
    try:
        progress(f"building {job.precision}", None)
        extra = dict(extra, **_build_artifact(job, cls, source, tmp, progress, calibration=legacy))
        manifest: dict[str, Any] = dict(
            extra,
            key_fields=key_fields(job, cls),
            backend=cls.name,
            precision=job.precision,
            source=job.source,
            created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        )
        if held is not None and reference is not None:
            gate = _gate(job, cls, tmp, held, reference, progress)
            # The search quantizes explicitly (Q/DQ): never with the legacy calibrator, whose
            # TensorRT build refuses a Q/DQ model, so every trial would fail.
            searchable = job.precision == "int8" and legacy is None and GateConfig(**job.gate).search == "auto"
            if not gate["passed"] and searchable:
                all_int8 = Path(source)  # the all-INT8 Q/DQ model just judged
                found = _mixed(job, cls, cache, calib, held, reference, gate, tmp, progress, all_int8)
                gate, extra = found.gate, dict(found.extra)
                manifest.update(extra)
            manifest["gate"] = gate
            if not gate["passed"]:
                return _reject(job, cls, cache, key, manifest, gate)
        manifest["build_seconds"] = round(time.monotonic() - started, 3)
        return cache.commit(job.model, key, cls.artifact_suffix, tmp, manifest)
    finally:
        if tmp.exists():
            tmp.unlink()


def _mixed(
    job: BuildJob,
    cls: type[Backend],
    cache: EngineCache,
    calib: Any,
    held: Any,
    reference: RunFn,
    gate: dict[str, Any],
    tmp: Path,
    progress: Progress,
    all_int8: Path,
) -> Found:
    """The mixed-precision search for an all-INT8 artefact that failed its gate, each trial built
    and judged by this pipeline's own build and gate against the same held-out samples."""
    from edged.quantize.mixed import mixed_precision

    def build_and_judge(qdq: Path, artefact: Path, excluded: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
        built = _build_artifact(job, cls, str(qdq), artefact, progress, excluded)
        return built, _gate(job, cls, artefact, held, reference, progress)

    return mixed_precision(job, cls, cache, calib, gate, tmp, progress, all_int8, build_and_judge)


def _reject(
    job: BuildJob, cls: type[Backend], cache: EngineCache, key: str, manifest: dict[str, Any], gate: dict[str, Any]
) -> Entry:
    fallback = fallback_precision(cls, job)
    if fallback is None:
        raise BuildError(
            f"{job.model}: {job.precision} failed the accuracy gate ({gate['reason']}), and {cls.name} can build "
            f"no lower precision of this model here"
        )
    reason = f"{job.precision} failed the accuracy gate ({gate['reason']}); serving {fallback}"
    log.warning("%s: %s", job.model, reason, extra={"model": job.model})
    return cache.commit(job.model, key, cls.artifact_suffix, None, dict(manifest, fallback=fallback, reason=reason))
