"""``precision = "auto"`` against an explicit int8 build of the demo detector: what the choice
costs at build time, and what it chose.

Each round builds the detector from an empty cache with ``edged build`` (the daemon's own
resolve and build child) once with ``precision = "int8"`` and once with ``"auto"``, the order
turning every round, with configs/demo.toml's profile, calibration (the demo's rendered pages)
and gate. It prints each build's wall time, the auto choice and the candidates' medians, and
writes them to ``bench-results/auto.json``.

    python -m bench auto [--rounds 2] [--out bench-results/auto.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from edged.config import load
from edged.tools.demo import detector_pages, extract_detector
from tests.helpers import write_config

REPO = Path(__file__).resolve().parent.parent


def _config(work: Path, precision: str, model: Path, pages: Path) -> Path:
    demo = load(REPO / "configs" / "demo.toml").models["ocr_det"]
    assert demo.calibration is not None
    calibration = {k: getattr(demo.calibration, k) for k in ("resize", "color", "mean", "std", "max_samples")}
    x = demo.profiles["x"]
    tables: dict[str, dict[str, Any]] = {
        "server": {"socket": str(work / "edged.sock")},
        "cache": {"dir": str(work / f"cache-{precision}")},
        "models.ocr_det": {"path": str(model), "backend": "onnxruntime", "precision": precision},
        "models.ocr_det.profiles.x": {"min": x.min, "opt": x.opt, "max": x.max},
        "models.ocr_det.calibration": dict(calibration, data=str(pages)),
        "models.ocr_det.gate": {"metric": list(demo.gate.metrics), "holdout": demo.gate.holdout},
    }
    return write_config(work / f"{precision}.toml", tables)


def _build(config: Path, cache: Path) -> tuple[float, dict[str, Any]]:
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "edged", "build", "--config", str(config)], check=True, capture_output=True)
    took = time.monotonic() - started
    found: dict[str, Any] = {}
    for path in cache.glob("ocr_det-*.json"):
        manifest = json.loads(path.read_text())
        found[manifest["precision"]] = manifest
    return took, found


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench auto", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("bench-results/auto.json"))
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="edged-bench-auto-") as tmp:
        work = Path(tmp)
        local = REPO / "data" / "models" / "ocr_det.onnx"
        model = local if local.exists() else extract_detector(work / "ocr_det.onnx")
        pages = detector_pages(work)
        configs = {p: _config(work, p, model, pages) for p in ("int8", "auto")}
        results: dict[str, list[Any]] = {"int8": [], "auto": []}
        for r in range(args.rounds):
            for precision in ("int8", "auto") if r % 2 == 0 else ("auto", "int8"):
                cache = work / f"cache-{precision}"
                shutil.rmtree(cache, ignore_errors=True)
                took, manifests = _build(configs[precision], cache)
                record = manifests.get("auto", {}).get("auto")
                results[precision].append({"seconds": round(took, 1), "auto": record})
                print(f"round {r + 1}: {precision} built in {took:.1f} s", flush=True)
                if record:
                    print(f"  chose {record['choice']['why']}", flush=True)
    summary = {p: statistics.median(x["seconds"] for x in runs) for p, runs in results.items()}
    print(f"median build: int8 {summary['int8']:.1f} s, auto {summary['auto']:.1f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rounds": results, "median_seconds": summary}, indent=2))
    return 0
