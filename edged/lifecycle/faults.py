"""Fault injection for the system and integration tests, wired in once at start-up and never
read on the request path.

``EDGED_TEST_WEDGE=PATH`` in the daemon's environment: every model instance is wrapped so that,
once the daemon is ready and while the file PATH exists, each request a worker thread takes
hangs on it, as a wedged GPU call would (the watchdog test and the MQTT poison test use it).
Without the variable nothing here is used.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping

import numpy as np

from edged.backends.base import Instance
from edged.serving.scheduler import WORKER_THREAD_PREFIX

WEDGE_ENV = "EDGED_TEST_WEDGE"


class WedgeSwitch:
    """Armed by the daemon once it is ready (warm-up and the request-path warm-up run free)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.armed = threading.Event()

    def wrap(self, inst: Instance) -> Instance:
        return _WedgeableInstance(inst, self)


class _WedgeableInstance(Instance):
    def __init__(self, inner: Instance, switch: WedgeSwitch) -> None:
        super().__init__(inner.backend, inner.threads)
        self._inner, self._switch = inner, switch
        self.runs_into = inner.runs_into

    def _infer_impl(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self._hang()
        return self._inner._infer_impl(inputs)

    def _infer_into_impl(
        self, inputs: Mapping[str, np.ndarray], into: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        self._hang()
        return self._inner._infer_into_impl(inputs, into)

    def _hang(self) -> None:
        # The scheduler's worker threads only: not a tiny model run inline on the event
        # loop (signals, the watchdog and health checks go on, as with a stuck GPU call).
        if self._switch.armed.is_set() and threading.current_thread().name.startswith(WORKER_THREAD_PREFIX):
            while os.path.exists(self._switch.path):
                time.sleep(0.05)


def wedge_switch_from_env() -> WedgeSwitch | None:
    path = os.environ.get(WEDGE_ENV)
    return WedgeSwitch(path) if path else None
