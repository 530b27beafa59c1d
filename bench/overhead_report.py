"""The overhead benchmark's figures: each lane as ratios to the in-process floors of the same run,
printed and written as JSON, and the daemon's stage timers given to the lanes they fell in."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from bench.measure import FLOOR, FLOOR_COPIES, FLOOR_PARKED, FLOOR_WORKER, Series
from bench.models import ModelSpec
from bench.peers import machine
from bench.stages import hops

REPO = Path(__file__).resolve().parent.parent

# The targets judged at c=1, each with the bound lanes that show whether any server on this stack
# can meet it: (lane, over lane, target, whether the lane is edged's or a bound's).
TARGETS: list[tuple[str, str, float, bool]] = [
    ("edged-posix", FLOOR_COPIES, 1.10, True),
    ("limitposix", FLOOR_COPIES, 1.10, False),
    ("edged", "echo", 1.5, True),
    ("limitv2", "echo", 1.5, False),
    ("limit", "echo", 1.5, False),
]


def targets(lanes: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each target of TARGETS whose two lanes ran at c=1: the ratio of their p50s and its verdict."""
    out = []
    for name, over, target, edged in TARGETS:
        a, b = lanes.get(name, {}).get("1"), lanes.get(over, {}).get("1")
        if a is None or b is None or b["p50_ms"] <= 0:
            continue
        ratio = a["p50_ms"] / b["p50_ms"]
        met = ratio <= target
        verdict = ("met" if met else "MISSED") if edged else f"bound: {'within' if met else 'past'}"
        out.append({"of": name, "over": over, "p50_ratio": ratio, "target": target, "verdict": verdict})
    return out


def report(
    spec: ModelSpec,
    results: dict[str, dict[int, Series]],
    placements: list[str],
    out: Path | None,
    stages: dict[str, dict[str, float]] | None = None,
    run: dict[str, int] | None = None,
) -> None:
    """Each lane's figures, as ratios to the floor's in the same rounds too, printed and written
    (``run``: the rounds and the starts they were shared among)."""
    lanes: dict[str, dict[str, Any]] = {}
    floors = {c: series.summary() for c, series in results.get(FLOOR, {}).items()}
    copied = {c: series.summary() for c, series in results.get(FLOOR_COPIES, {}).items()}
    parked = {c: series.summary() for c, series in results.get(FLOOR_PARKED, {}).items()}
    handed = {c: series.summary() for c, series in results.get(FLOOR_WORKER, {}).items()}
    for name, by_conc in results.items():
        for c, series in by_conc.items():
            d = series.summary()
            floor = floors.get(c)
            if floor is not None and floor["p50_ms"] > 0:
                d["p50_over_floor"] = d["p50_ms"] / floor["p50_ms"]
            lanes.setdefault(name, {})[str(c)] = d
            ratio = f"  {d['p50_over_floor']:6.3f}x floor" if "p50_over_floor" in d else ""
            copies = copied.get(c)
            if copies is not None and copies["p50_ms"] > 0 and name != FLOOR_COPIES:
                d["p50_over_copies"] = d["p50_ms"] / copies["p50_ms"]
                ratio += f"  {d['p50_over_copies']:6.3f}x floor+copies"
            pool = parked.get(c)
            if pool is not None and pool["p50_ms"] > 0 and name not in (FLOOR_COPIES, FLOOR_PARKED):
                d["p50_over_parked"] = d["p50_ms"] / pool["p50_ms"]
                ratio += f"  {d['p50_over_parked']:6.3f}x parked"
            hop = handed.get(c)
            if hop is not None and hop["p50_ms"] > 0 and name not in (FLOOR_COPIES, FLOOR_PARKED, FLOOR_WORKER):
                d["p50_over_worker"] = d["p50_ms"] / hop["p50_ms"]
                ratio += f"  {d['p50_over_worker']:6.3f}x on a worker"
            print(
                f"{spec.name} {name:23} c={c}  p50 {d['p50_ms']:.4f} ms  p90 {d['p90_ms']:.4f}  "
                f"p99 {d['p99_ms']:.4f} ms  {d['throughput_rps']:8.0f} req/s{ratio}",
                flush=True,
            )
    for line in placements:
        print(line, flush=True)
    for lane, med in (stages or {}).items():
        print(f"{spec.name} {lane:27} stages, medians (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in med.items()))
    judged = targets(lanes)
    for t in judged:
        print(f"{spec.name} {t['of']} / {t['over']}: {t['p50_ratio']:.3f}x, target <= {t['target']}: {t['verdict']}")
    out = out or REPO / "bench-results" / f"overhead_{spec.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "model": spec.name,
        "machine": machine(),
        **(run or {}),
        "lanes": lanes,
        "placement": placements,
        "stages": stages,
        "targets": judged,
    }
    out.write_text(json.dumps(doc, indent=2))
    print(f"written to {out}", flush=True)


def lane_stages(path: Path, windows: list[tuple[str, float, float]], model: str) -> dict[str, dict[str, float]]:
    """Per lane, the median of each stage the daemon timed (ms), and of the two hand-offs to the
    model's worker and back (from the stages' start and end times)."""
    per: dict[str, dict[str, list[float]]] = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec["path"] != f"/v2/models/{model}/infer":
            continue
        lane = next((name for name, t0, t1 in windows if t0 <= rec["at"] <= t1), None)
        if lane is None:  # the warm-up's, the checks', the unrecorded first bursts' requests
            continue
        mine = per.setdefault(lane, {})
        for stage, ms in rec["ms"].items():
            mine.setdefault(stage, []).append(ms)
        worker = hops(rec["at_ms"]).get("to worker")
        if worker is not None:
            mine.setdefault("to worker", []).append(worker[0])
            mine.setdefault("back", []).append(worker[1])
    return {lane: {k: statistics.median(v) for k, v in stages.items()} for lane, stages in per.items()}
