"""Inputs the daemon lifecycle system tests share: the demo detector's shape profile, an input
for the tiny model, and a deterministic image frame of a given size.
"""

from __future__ import annotations

import numpy as np

DET_PROFILE = {"min": [1, 3, 32, 32], "opt": [1, 3, 320, 320], "max": [1, 3, 640, 640]}
X = np.linspace(-1.0, 1.0, 16, dtype=np.float32).reshape(1, 16)


def frame(size: int) -> np.ndarray:
    return np.random.default_rng(3).random((1, 3, size, size), dtype=np.float32)
