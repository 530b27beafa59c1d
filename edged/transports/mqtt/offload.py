"""Worker threads for the MQTT work whose cost grows with a message: reading properties and
payloads, encoding large replies. The event loop only moves bytes.

Not asyncio's default executor: its threads are joined at interpreter exit, so one pathological
message still being decoded would hold up a SIGTERM, and a burst of large messages would queue
ahead of the daemon's other thread work (hashing, probes). These are daemon threads that a
stopping edged leaves behind: a message they were reading was not acknowledged, so the broker
redelivers it and the next start drops it as 'redelivered'.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from edged.thread_to_loop import to_loop

log = logging.getLogger(__name__)

T = TypeVar("T")
_Job = tuple[asyncio.Future[Any], Callable[[], Any]]


class Offload:
    def __init__(self, loop: asyncio.AbstractEventLoop, workers: int, name: str = "edged-mqtt") -> None:
        self.loop = loop
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)]
        self._started = False

    async def run(self, fn: Callable[[], T]) -> T:
        if not self._started:
            self._started = True
            for t in self._threads:
                t.start()
        fut: asyncio.Future[T] = self.loop.create_future()
        self._jobs.put((fut, fn))
        return await fut

    def close(self) -> None:
        """Let idle workers exit; a busy one ends with its job (or with the process)."""
        for _ in self._threads:
            self._jobs.put(None)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fut, fn = job
            if fut.cancelled():
                continue
            try:
                result = fn()
            except BaseException as e:  # handed to the awaiting task, which turns it into a reply
                self._settle(fut, None, e)
            else:
                self._settle(fut, result, None)

    def _settle(self, fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
        def done() -> None:
            if fut.cancelled():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        to_loop(self.loop, done)  # dropped once the loop has closed: edged is exiting
