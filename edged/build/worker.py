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
from typing import IO, Any

from edged.backends import backend_class
from edged.build.job import BuildJob
from edged.build.pipeline import build_precision
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


def run(job: BuildJob, events: Events) -> Entry:
    cls = backend_class(job.backend)
    cache = EngineCache(job.cache_dir)
    cache.prepare()
    return build_precision(job, cls, cache, events.progress)


def main() -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
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
