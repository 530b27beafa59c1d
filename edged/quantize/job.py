"""What a build is asked to do, and the cache key that names its result.

The key is computed in one place for the daemon, ``edged build`` and the build child, so a model
that falls back to another precision inside the child lands under the same key the parent will
look up next boot.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec

from edged.backends.base import Backend
from edged.cache.store import cache_key
from edged.config import ModelConfig
from edged.quantize.choice import MARGIN

# The build option naming the Q/DQ model's nodes a mixed-precision search kept out of INT8:
# ONNX Runtime runs them FP32 as written; TensorRT may run them FP16.
FLOAT_NODES_OPTION = "int8_float_nodes"
# Part of every cache key with the backend's own ``build_recipe``: change it with any change to
# what the pipeline makes of the same inputs (the Q/DQ recipe, the search, the fallback), so that
# entries already cached are built again the new way rather than served as they were.
PIPELINE_RECIPE = "1"
# Part of the key of a ``precision = "auto"`` choice: change it with any change to how the
# candidates are timed or chosen, so that choices already made are made again.
AUTO_RECIPE = "1"


@dataclass(frozen=True)
class BuildJob:
    model: str
    source: str
    precision: str
    backend: str
    cache_dir: str
    source_digest: str
    profiles: dict[str, list[list[int]]] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    calibration: dict[str, Any] | None = None
    calibration_digest: str = ""
    gate: dict[str, Any] = field(default_factory=dict)
    # cache.generation_tag: an operator's forced new generation (empty: not part of the key).
    generation_tag: str = ""
    # precision = "auto": what the candidates are timed with (the warm-up table, threads and
    # instances the model serves with); empty otherwise.
    timing: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> BuildJob:
        return cls(**raw)

    def at_precision(self, precision: str) -> BuildJob:
        return BuildJob(**dict(self.to_dict(), precision=precision))


def backend_options(model: ModelConfig, backend: str) -> dict[str, Any]:
    """Options that change the artefact a backend builds (and so belong in the key)."""
    if backend != "tensorrt":
        return {}
    options = dict(msgspec.structs.asdict(model.tensorrt))
    if model.profiles and model.instances > 1:
        # TensorRT 8.5 gives each execution context a profile of its own, so the engine holds
        # one per instance and the count belongs in the key there (and only there).
        from edged.backends.tensorrt import TensorRTBackend

        if TensorRTBackend.profiles_per_engine(model.instances) > 1:
            options["instances"] = model.instances
    return options


def key_fields(job: BuildJob, cls: type[Backend]) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "model_sha256": job.source_digest,
        "precision": job.precision,
        "profiles": job.profiles,
        "backend": cls.name,
        "backend_version": cls.version(),
        "device": cls.device_fingerprint(job.options),
        "options": job.options,
        "recipe": {"pipeline": PIPELINE_RECIPE, "backend": cls.build_recipe},
    }
    if job.precision in ("int8", "auto") and job.calibration is not None:
        fields["calibration"] = {
            "digest": job.calibration_digest,
            "method": job.calibration.get("method"),
            "percentile": job.calibration.get("percentile"),
        }
    if job.precision != "fp32" and job.calibration is not None:
        # The held-out share decides which samples calibrate, the thresholds decide the verdict.
        fields["gate"] = job.gate
    if job.precision == "auto":
        # The choice rests on timings at these shapes and threads, by this rule: any change
        # makes it again. The device is in the key above, so another device chooses anew.
        fields["auto"] = {"recipe": AUTO_RECIPE, "margin": MARGIN, "timing": job.timing}
    if job.generation_tag:
        fields["generation_tag"] = job.generation_tag
    return fields


def job_key(job: BuildJob, cls: type[Backend]) -> str:
    return cache_key(key_fields(job, cls))


def make_job(
    name: str,
    model: ModelConfig,
    cls: type[Backend],
    precision: str,
    cache_dir: str,
    digest: Callable[[str], str],
    calibration_digest: Callable[[ModelConfig], str] | None = None,
    generation_tag: str = "",
) -> BuildJob:
    profiles = {k: [p.min, p.opt, p.max] for k, p in sorted(model.profiles.items())}
    cal = msgspec.structs.asdict(model.calibration) if model.calibration is not None else None
    cal_digest = ""
    if precision in ("int8", "auto") and model.calibration is not None and calibration_digest is not None:
        cal_digest = calibration_digest(model)
    timing: dict[str, Any] = {}
    if precision == "auto":
        warmup = msgspec.to_builtins(model.warmup)
        timing = {"warmup": warmup, "threads": model.threads, "instances": model.instances}
    return BuildJob(
        model=name,
        source=model.path,
        precision=precision,
        backend=cls.name,
        cache_dir=cache_dir,
        source_digest=digest(model.path),
        profiles=profiles,
        options=backend_options(model, cls.name),
        calibration=cal,
        calibration_digest=cal_digest,
        gate=msgspec.structs.asdict(model.gate),
        generation_tag=generation_tag,
        timing=timing,
    )
