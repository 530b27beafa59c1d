"""The data ``edged selftest`` makes for its demo models (see ``edged.tools.selftest_checks``):
rendered text pages for the detector, document-like pictures and normal values for any other
model's inputs, written as the sample folders the daemon's loader reads."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

Feed = dict[str, np.ndarray]
Profiles = dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]
WORDS = ("edged", "Jetson", "INT8", "engine", "warm", "ready", "frame", "camera", "Orin", "text", "page", "model")


def input_specs(path: Path, profiles: Profiles) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape at the profile's opt, numpy dtype) of each model input."""
    from edged.backends.onnxruntime import OnnxRuntimeBackend, ort_session

    specs = []
    for spec in OnnxRuntimeBackend.specs_of(ort_session(str(path))):
        shape = profiles[spec.name][1] if spec.name in profiles else tuple(d if d > 0 else 1 for d in spec.shape)
        specs.append((spec.name, tuple(shape), spec.dtype))
    return specs


def synthetic_feeds(specs: Sequence[tuple[str, tuple[int, ...], str]], count: int, seed: int) -> list[Feed]:
    """Image inputs get document-like pictures (a light page with dark strokes, normalised as
    ImageNet models expect); other inputs standard normal values."""
    rng = np.random.default_rng(seed)
    feeds = []
    for _ in range(count):
        feed = {}
        for name, shape, dtype in specs:
            arr = _page(rng, shape) if len(shape) == 4 and shape[1] == 3 else rng.standard_normal(shape)
            feed[name] = arr.astype(dtype)
        feeds.append(feed)
    return feeds


def _page(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    n, c, h, w = shape
    img = np.empty(shape, np.float32)
    for i in range(n):
        page = np.full((h, w), rng.uniform(0.75, 0.95), np.float32)
        page += np.linspace(0, rng.uniform(-0.1, 0.1), w, dtype=np.float32)[None, :]
        for _ in range(int(rng.integers(5, 25))):
            y, x = int(rng.integers(0, h)), int(rng.integers(0, w))
            length = int(rng.integers(max(1, w // 20), max(2, w // 3)))
            page[y : y + max(2, h // 40), x : x + length] = rng.uniform(0.0, 0.3)
        img[i] = page[None] + rng.normal(0, 0.02, (c, h, w))
    mean = np.array([0.485, 0.456, 0.406], np.float32)[:, None, None]
    std = np.array([0.229, 0.224, 0.225], np.float32)[:, None, None]
    return (img - mean) / std


def write_feeds(folder: Path, feeds: Sequence[Feed]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    savez: Any = np.savez  # numpy's stub reads **arrays as its allow_pickle keyword
    for i, feed in enumerate(feeds):
        savez(folder / f"sample{i:04d}.npz", **feed)
    return folder


def render_pages(folder: Path, count: int, size: int = 640) -> Path:
    """Light pages with lines of dark text: what a text detector is for (its calibration and
    held-out data go through the daemon's own image loader)."""
    from PIL import Image, ImageDraw, ImageFont

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(2024)
    for i in range(count):
        img = Image.new("RGB", (size, size), tuple(int(v) for v in rng.integers(190, 256, 3)))
        draw = ImageDraw.Draw(img)
        y = int(rng.integers(4, 24))
        while y < size - 40:
            height = int(rng.integers(14, 40))
            try:
                font: Any = ImageFont.load_default(size=height)
            except TypeError:  # Pillow < 10.1 has one bitmap size
                font = ImageFont.load_default()
            words = " ".join(rng.choice(WORDS, int(rng.integers(1, 6))))
            ink = tuple(int(v) for v in rng.integers(0, 90, 3))
            draw.text((int(rng.integers(4, size // 4)), y), words, fill=ink, font=font)
            y += height + int(rng.integers(6, 40))
        img.save(folder / f"page{i:03d}.png")
    return folder
