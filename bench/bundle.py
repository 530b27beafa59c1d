"""What checking a signed bundle costs against the floor, hashing its bytes once with hashlib:
``open_bundle`` of the same bundle signed (model-signing verifies the signature and hashes every
file) and unsigned (edged hashes every file), interleaved round by round.

  scripts/bench.sh bundle [--quick] [--out bench-results/bundle.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from edged.fleet.bundle import make_bundle, open_bundle, sign_bundle
from tests.fleet_keys import make_key

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def _floor(root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != "bundle.sig":
            with open(p, "rb") as f:
                h = hashlib.sha256()
                while chunk := f.read(MiB):
                    h.update(chunk)


def _bundle(work: Path, size: int) -> Path:
    src = work / f"model-{size}.onnx"
    with open(src, "wb") as f:
        for _ in range(size // MiB):
            f.write(os.urandom(MiB))
    return make_bundle(
        work / f"b-{size}", name="bench", version="1.0.0", model={"path": "model.onnx"}, files={"model.onnx": src}
    )


def measure(work: Path, size: int, rounds: int) -> dict[str, object]:
    key = make_key(work, f"k{size}")
    signed = _bundle(work, size)
    sign_bundle(signed, key.private)
    unsigned = _bundle(work / "u", size)
    cases: dict[str, Callable[[], object]] = {
        "sha256 floor": lambda: _floor(signed),
        "open_bundle signed": lambda: open_bundle(signed, [key.public], require_signed=True),
        "open_bundle unsigned": lambda: open_bundle(unsigned, [], require_signed=False),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():  # one untimed pass each: imports and the page cache
        fn()
    for _ in range(rounds):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    floor = statistics.median(times["sha256 floor"])
    return {
        name: {"median_s": statistics.median(ts), "ratio_to_floor": statistics.median(ts) / floor}
        for name, ts in times.items()
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(REPO / "bench-results" / "bundle.json"))
    args = ap.parse_args(argv)
    sizes, rounds = ([4 * MiB, 64 * MiB], 3) if args.quick else ([4 * MiB, 64 * MiB, 512 * MiB], 7)
    results: dict[str, object] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}
    }
    with tempfile.TemporaryDirectory(prefix="edged-bench-bundle-") as tmp:
        (Path(tmp) / "u").mkdir()
        for size in sizes:
            results[f"{size // MiB}MiB"] = measure(Path(tmp), size, rounds)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    for size_name, rows in results.items():
        if size_name == "machine":
            continue
        assert isinstance(rows, dict)
        for name, r in rows.items():
            print(f"{size_name:>7}  {name:<22} {r['median_s'] * 1000:9.1f} ms  {r['ratio_to_floor']:5.2f}x floor")
    return 0
