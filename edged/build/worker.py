"""The build child process: ``python -m edged.build.worker`` reads one job (JSON) on stdin,
builds it into the cache under the entry's lock, and reports events as JSON lines.

It runs apart from the daemon because a build can take minutes, exhaust memory or crash in native
code; whatever happens here, the daemon keeps serving and the cache keeps only finished entries.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import IO, Any

from edged.backends import backend_class
from edged.backends.base import Backend, BuildSpec
from edged.build.job import BuildJob, job_key, key_fields
from edged.cache import EngineCache, Entry

log = logging.getLogger("edged.build")


class Events:
    """Events go to a private copy of stdout; stdout itself is pointed at stderr so that a
    library printing during the build cannot corrupt the event stream."""

    def __init__(self) -> None:
        self._out: IO[str] = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)

    def emit(self, event: str, **fields: Any) -> None:
        self._out.write(json.dumps(dict(fields, event=event)) + "\n")

    def progress(self, phase: str, fraction: float | None) -> None:
        self.emit("progress", phase=phase, fraction=fraction)


def build_entry(job: BuildJob, cls: type[Backend], cache: EngineCache, events: Events) -> Entry:
    """Build one entry at the job's precision, unless another process already did."""
    key = job_key(job, cls)
    with cache.lock(job.model, key):
        existing = cache.lookup(job.model, key, cls.artifact_suffix)
        if existing is not None:
            return existing
        started = time.monotonic()
        tmp = cache.temp_path(cls.artifact_suffix)
        try:
            spec = BuildSpec(
                source=job.source, precision=job.precision,
                profiles={k: (tuple(v[0]), tuple(v[1]), tuple(v[2])) for k, v in job.profiles.items()},
                options=job.options,
            )
            extra = cls.build(spec, tmp, events.progress)
            manifest = dict(
                extra, key_fields=key_fields(job, cls), backend=cls.name, precision=job.precision,
                source=job.source, build_seconds=round(time.monotonic() - started, 3),
                created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            )
            return cache.commit(job.model, key, cls.artifact_suffix, tmp, manifest)
        finally:
            if tmp.exists():
                tmp.unlink()


def run(job: BuildJob, events: Events) -> Entry:
    cls = backend_class(job.backend)
    cache = EngineCache(job.cache_dir)
    cache.prepare()
    return build_entry(job, cls, cache, events)


def main() -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    events = Events()
    try:
        job = BuildJob.from_dict(json.loads(sys.stdin.read()))
        entry = run(job, events)
    except Exception as e:
        log.exception("build failed")
        events.emit("error", message=f"{e.__class__.__name__}: {e}")
        return 1
    events.emit("done", key=entry.key, manifest=entry.manifest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
