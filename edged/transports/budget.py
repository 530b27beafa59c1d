"""Bytes of request bodies held at once, over every transport: HTTP's bodies as they are read and
held, gRPC's request messages under way on the Unix relay (server.bodies_in_flight)."""

from __future__ import annotations

import threading
import weakref

import numpy as np

from edged.errors import BodyBudgetError


class BodyBudget:
    """Bytes of request bodies held at once, all connections together. Taken from any thread (an
    inflation runs on a worker), given back by the finalizer of the buffer that holds them."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        with self._lock:
            if self.used + n > self.limit:
                raise BodyBudgetError(
                    f"request bodies in flight would exceed {self.limit} bytes (server.bodies_in_flight); retry later"
                )
            self.used += n

    def give(self, n: int) -> None:
        with self._lock:
            self.used -= n

    def hold(self, buf: np.ndarray, n: int) -> memoryview:
        """``buf``'s bytes as a view, ``n`` of the budget held until the last view of them goes."""
        weakref.finalize(buf, self.give, n)
        return buf.data
