"""The build child process: ``python -m edged.quantize.worker`` reads one job (JSON) on stdin,
builds it into the cache under the entry's lock, and reports events as JSON lines.

It runs apart from the daemon because a build can take minutes, exhaust memory or crash in native
code; whatever happens here, the daemon keeps serving and the cache keeps only finished entries.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import sys
import time
from typing import IO, Any

from edged.backends import backend_class
from edged.cache.store import EngineCache, Entry
from edged.config import format_size
from edged.quantize.auto import build_auto
from edged.quantize.job import BuildJob
from edged.quantize.pipeline import build_precision

log = logging.getLogger("edged.quantize")


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


# Test-only: seconds a build waits before it starts ("30", or per model "slow=30,other=2"), so tests
# can watch a slow build (a stand-in serving, a timeout). Read here, in the build child, never by
# the daemon or on a request path.
TEST_DELAY_ENV = "EDGED_TEST_BUILD_DELAY_S"
# Libraries writing a model lose the errno of a full disk (ONNX Runtime says "Protobuf
# serialization failed"), and the pipeline removes the partial file before the error gets here: a
# failed build whose cache has less room than the model needs (about its size) was a full disk.
_DISK_FULL_MARGIN = 1 << 20


def _test_delay(events: Events, model: str) -> None:
    raw = os.environ.get(TEST_DELAY_ENV) or "0"
    if "=" in raw:
        delays = dict(part.split("=", 1) for part in raw.split(","))
        raw = delays.get(model, "0")
    delay = float(raw)
    end = time.monotonic() + delay
    while (left := end - time.monotonic()) > 0:
        events.progress("waiting (test delay)", 1 - left / delay)
        time.sleep(min(0.1, left))


def run(job: BuildJob, events: Events) -> Entry:
    cls = backend_class(job.backend)
    cache = EngineCache(job.cache_dir)
    cache.prepare()
    _test_delay(events, job.model)
    build = build_auto if job.precision == "auto" else build_precision
    return build(job, cls, cache, events.progress)


def disk_full(e: BaseException, directory: str, needed: int) -> str:
    """'' unless the failure is a full disk; then a message that says so, with the free space."""
    chain: BaseException | None = e
    full = False
    while chain is not None:
        full = full or (isinstance(chain, OSError) and chain.errno in (errno.ENOSPC, errno.EDQUOT))
        chain = chain.__cause__ or chain.__context__
    try:
        st = os.statvfs(directory)
        free = st.f_bavail * st.f_frsize
    except OSError:
        return "no space left on device (ENOSPC)" if full else ""
    if full or free < needed + _DISK_FULL_MARGIN:
        return (
            f"no space left on device (ENOSPC): {directory} has {format_size(free)} free, "
            f"the engine needs about {format_size(needed)}; free some space and reload"
        )
    return ""


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def main() -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    events = Events()
    job: BuildJob | None = None
    try:
        job = BuildJob.from_dict(json.loads(sys.stdin.read()))
        entry = run(job, events)
    except Exception as e:
        log.exception("build failed")
        full = disk_full(e, job.cache_dir, _size(job.source)) if job is not None else ""
        if job is not None:
            EngineCache(job.cache_dir).remove_temporaries(os.getpid())
        events.emit("error", message=full or f"{e.__class__.__name__}: {e}")
        return 1
    events.emit("done", key=entry.key, manifest=entry.manifest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
