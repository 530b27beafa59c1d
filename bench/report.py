"""Turning a run into figures: the names and labels of every lane, summaries with ratios to the
floor, and the targets with their bounds and whether they were met. The Markdown report is
bench/report_markdown.py, the PNG plots bench/report_plots.py."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from bench.measure import FLOOR, Series

LIMIT = "limit"  # the echo's stack running the model on its loop (bench/limit.py): no server does better
LIMIT_WORKER = "limitworker"  # the same with the run on a worker thread: the bound for a loop kept free
LIMIT_V2 = "limitv2"  # the least an Open Inference Protocol server does on the stack: the protocol's bound
LIMITS = (LIMIT, LIMIT_WORKER, LIMIT_V2)
# edged's daemon a second time, same code and configuration (serving only): how far two daemons
# that should measure the same differ in this run, shown beside every figure of edged's target.
TWIN = "edged-twin"
LABEL = {
    FLOOR: "in-process (floor)",
    "edged": "edged",
    TWIN: "edged, a second daemon of the same code",
    "fastapi": "FastAPI (hand-written)",
    "pytriton": "PyTriton",
    LIMIT: "limit: echo + model on the loop",
    LIMIT_WORKER: "limit: echo + model on a worker thread",
    LIMIT_V2: "limit: V2 decode + model on the loop + V2 encode",
}
TRANSPORT = {
    FLOOR: "-",
    LIMIT: "Unix socket; the input held by the server",
    LIMIT_WORKER: "Unix socket; the input held by the server",
    LIMIT_V2: "Unix socket; binary V2 request and answer",
    "edged": "Unix socket; frames via shm",
    TWIN: "Unix socket; frames via shm",
    "fastapi": "Unix socket; raw bytes",
    "pytriton": "HTTP on 127.0.0.1; frames via shm",
}
ServingSeries = dict[str, dict[str, dict[int, Series]]]


def peers_of(targets: dict[str, Any]) -> list[str]:
    """The servers other than edged that ran (PyTriton is left out when it is not set up)."""
    return [
        n
        for n in dict.fromkeys(("fastapi", "pytriton", *targets))
        if n in targets and n not in (FLOOR, "edged", TWIN, *LIMITS)
    ]


def _limit(lanes: dict[str, Any], c: str, key: str, lane: str = LIMIT) -> float | None:
    """A limit lane's figure, where the run had one."""
    return lanes[lane][c][key] if lane in lanes else None


def summarize(series: ServingSeries) -> dict[str, Any]:
    """serving[model][target][concurrency] with each figure's ratio to the floor's."""
    out: dict[str, Any] = {}
    for model, targets in series.items():
        floor = {c: s.summary() for c, s in targets[FLOOR].items()}
        out[model] = {}
        for name, by_conc in targets.items():
            out[model][name] = {}
            for c, s in by_conc.items():
                d = s.summary()
                f = floor[c]
                d["p50_ratio"] = d["p50_ms"] / f["p50_ms"]
                d["p99_ratio"] = d["p99_ms"] / f["p99_ms"]
                d["throughput_ratio"] = d["throughput_rps"] / f["throughput_rps"]
                out[model][name][str(c)] = d
    return out


def summarize_scheduler(sched: dict[str, Any]) -> dict[str, Any]:
    cases = {f"{name}@c{c}": s.summary() for name, by_conc in sched["series"].items() for c, s in by_conc.items()}
    for d in cases.values():
        d.pop("quantiles_ms", None)
    return {
        "cases": cases,
        "variants": sched["variants"],
        "status": sched["status"],
        "failures": sched.get("failures", []),
    }


def _med(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def cold_summary(starts: list[dict[str, Any]]) -> dict[str, Any]:
    models = list(starts[0]["first_ms"])
    out: dict[str, Any] = {
        "ready_s": _med([s["ready_s"] for s in starts]),
        "rss_mib": _med([s["memory"]["rss_mib"] for s in starts]),
        "pss_mib": _med([s["memory"]["pss_mib"] for s in starts]),
        "processes": starts[0]["memory"]["processes"],
        "leftover_pids": sum(len(s["leftover_pids"]) for s in starts),
    }
    for key in ("first_ms", "steady_ms", "after_gap_ms"):
        out[key] = {m: _med([s[key][m] for s in starts]) for m in models}
    out["first_over_steady"] = {m: out["first_ms"][m] / out["steady_ms"][m] for m in models}
    out["first_over_after_gap"] = {m: out["first_ms"][m] / out["after_gap_ms"][m] for m in models}
    # Requests after the gap per start and model (1 for a results file without after_gaps_ms).
    out["after_gaps_per_start"] = len(starts[0].get("after_gaps_ms", {}).get(models[0], [0.0]))
    if "warmup_s" in starts[0]:
        out["warmup_s"] = _med([s["warmup_s"] for s in starts])
        out["ready_minus_warmup_s"] = _med([s["ready_s"] - s["warmup_s"] for s in starts])
    return out


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets, each with the figure, the bound and whether it was met."""
    sv, cold = r["serving"], {n: cold_summary(v) for n, v in r["cold_start"].items()}
    r["cold_summary"] = cold
    rows: list[dict[str, Any]] = []
    peers = peers_of(sv["tiny"])
    _latency_targets(rows, sv, peers)
    _throughput_targets(rows, sv, peers)
    e = cold["edged"]
    _first_request_targets(rows, e)
    _batching_targets(rows, r["scheduler"]["cases"])
    _add(
        rows,
        "start → ready, 3 models, cache hit, less warm-up",
        e["ready_minus_warmup_s"],
        1.0,
        "s",
        f"ready {e['ready_s']:.2f} s incl. warm-up {e['warmup_s']:.2f} s",
    )
    return rows


def _add(
    rows: list[dict[str, Any]],
    what: str,
    value: float,
    bound: float,
    unit: str,
    peers: str = "",
    higher: bool = False,
    limit: float | None = None,
    worker_limit: float | None = None,
    v2_limit: float | None = None,
    twin: float | None = None,
) -> None:
    """Append one target's row to ``rows``: whether it was met, and beside the peers' figures the
    A/A spread and the limits the machine allows."""
    met = value >= bound if higher else value <= bound
    if twin is not None:  # the A/A spread: the same figure from a second daemon of the same code
        peers = f"a second edged daemon {fmt(twin)} {unit}; " + peers
    if limit is not None:  # what the machine allows: a bound past it cannot be met by any server
        peers += f"; limit {fmt(limit)} {unit}" + (" (the bound is past it)" if (limit < bound) == higher else "")
    if worker_limit is not None:  # the same for a server that keeps its loop free during a run
        peers += f", with the run on a worker thread {fmt(worker_limit)} {unit}"
    if v2_limit is not None:  # the least a server that speaks the protocol does
        past = " (the bound is past it)" if (v2_limit < bound) == higher else ""
        peers += f", with the protocol's decode and encode {fmt(v2_limit)} {unit}{past}"
    rows.append(
        {
            "target": what,
            "value": value,
            "bound": bound,
            "unit": unit,
            "met": met,
            "higher_is_better": higher,
            "margin": value / bound,
            "peers": peers,
            "limit": limit,
        }
    )


def _latency_targets(rows: list[dict[str, Any]], sv: dict[str, Any], peers: list[str]) -> None:
    """tiny's p50 at c=1, and each frame model's p50 at c=1 over the in-process floor's."""
    tiny = sv["tiny"]
    _add(
        rows,
        "tiny MLP p50 at c=1",
        tiny["edged"]["1"]["p50_ms"],
        0.10,
        "ms",
        ", ".join(f"{LABEL[p]} {tiny[p]['1']['p50_ms']:.3f}" for p in peers),
        limit=_limit(tiny, "1", "p50_ms"),
        twin=_limit(tiny, "1", "p50_ms", TWIN),
        v2_limit=_limit(tiny, "1", "p50_ms", LIMIT_V2),
    )
    for model, bound in (("conv640", 1.10), ("ocr_det", 1.05)):
        d = sv[model]
        _add(
            rows,
            f"{model} frame p50 at c=1 / in-process",
            d["edged"]["1"]["p50_ratio"],
            bound,
            "x",
            ", ".join(f"{LABEL[p]} {d[p]['1']['p50_ratio']:.2f}x" for p in peers),
            limit=_limit(d, "1", "p50_ratio"),
            worker_limit=_limit(d, "1", "p50_ratio", LIMIT_WORKER),
            twin=_limit(d, "1", "p50_ratio", TWIN),
        )


def _throughput_targets(rows: list[dict[str, Any]], sv: dict[str, Any], peers: list[str]) -> None:
    """Each model's throughput at c=4 over the best peer's."""
    for model, d in sv.items():
        best = max(peers, key=lambda p: d[p]["4"]["throughput_rps"])
        _add(
            rows,
            f"{model} throughput at c=4 / best peer ({LABEL[best]})",
            d["edged"]["4"]["throughput_rps"] / d[best]["4"]["throughput_rps"],
            1.5,
            "x",
            f"edged {d['edged']['4']['throughput_rps']:.0f}/s, {LABEL[best]} {d[best]['4']['throughput_rps']:.0f}/s",
            higher=True,
            limit=None if LIMIT not in d else d[LIMIT]["4"]["throughput_rps"] / d[best]["4"]["throughput_rps"],
            twin=None if TWIN not in d else d[TWIN]["4"]["throughput_rps"] / d[best]["4"]["throughput_rps"],
        )


def _first_request_targets(rows: list[dict[str, Any]], e: dict[str, Any]) -> None:
    """edged's first request per model over one after the same idle gap (``e``: its cold summary)."""
    for model in e["first_ms"]:
        _add(
            rows,
            f"first request / after the same idle gap, {model}",
            e["first_over_after_gap"][model],
            1.2,
            "x",
            f"first {e['first_ms'][model]:.3f} ms, after the gap {e['after_gap_ms'][model]:.3f} ms (medians)",
        )


def _batching_targets(rows: list[dict[str, Any]], cases: dict[str, Any]) -> None:
    """Each batched model's throughput at c=16 over its unbatched twin's, where the run had both."""
    for base, batched in (("tiny_b1", "tiny_b16"), ("mlp2k_b1", "mlp2k_b16"), ("conv640_b1", "conv640_b8")):
        if f"{base}@c16" not in cases:
            continue
        # Batching never costs: at least the unbatched model's throughput (`bench batching` has
        # every concurrency and the c=1 latency, side by side).
        a, b = cases[f"{base}@c16"]["throughput_rps"], cases[f"{batched}@c16"]["throughput_rps"]
        _add(
            rows,
            f"dynamic batching at c=16, {batched} / {base}",
            b / a,
            1.0,
            "x",
            f"{b:.0f}/s vs {a:.0f}/s",
            higher=True,
        )


def fmt(v: float, digits: int = 3) -> str:
    """A figure for the report's tables: whole from 100, one decimal from 10, else ``digits``."""
    if v >= 100:
        return f"{v:.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.{digits}f}"
