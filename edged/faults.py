"""Fault injection for the system and integration tests, wired in once at start-up and never
read on the request path.

``EDGED_TEST_WEDGE=PATH`` in the daemon's environment: every model instance is wrapped so that,
while the file PATH exists, each request it takes hangs on it in its worker thread, as a wedged GPU call would (the
watchdog test and the MQTT poison test use it). Without the variable nothing here is used.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping

import numpy as np

from edged.backends.base import Instance

WEDGE_ENV = "EDGED_TEST_WEDGE"

InstanceWrapper = Callable[[Instance], Instance]


class _WedgeableInstance(Instance):
    def __init__(self, inner: Instance, path: str) -> None:
        super().__init__(inner.backend)
        self._inner, self._path = inner, path

    def _infer_impl(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        # Worker threads only: a tiny model run inline on the event loop is not wedged, so the
        # loop (signals, the watchdog, health checks) goes on as it would with a stuck GPU call.
        while threading.current_thread() is not threading.main_thread() and os.path.exists(self._path):
            time.sleep(0.05)
        return self._inner._infer_impl(inputs)


def instance_wrapper_from_env() -> InstanceWrapper | None:
    path = os.environ.get(WEDGE_ENV)
    if not path:
        return None
    return lambda inst: _WedgeableInstance(inst, path)
