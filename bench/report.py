"""Turning a run into figures: summaries with ratios to the floor, the targets, a Markdown
report and PNG plots (latency distributions, throughput, the cold-start timeline)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
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

    def add(
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
        met = value >= bound if higher else value <= bound
        if twin is not None:  # the A/A spread: the same figure from a second daemon of the same code
            peers = f"a second edged daemon {_f(twin)} {unit}; " + peers
        if limit is not None:  # what the machine allows: a bound past it cannot be met by any server
            peers += f"; limit {_f(limit)} {unit}" + (" (the bound is past it)" if (limit < bound) == higher else "")
        if worker_limit is not None:  # the same for a server that keeps its loop free during a run
            peers += f", with the run on a worker thread {_f(worker_limit)} {unit}"
        if v2_limit is not None:  # the least a server that speaks the protocol does
            past = " (the bound is past it)" if (v2_limit < bound) == higher else ""
            peers += f", with the protocol's decode and encode {_f(v2_limit)} {unit}{past}"
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

    tiny = sv["tiny"]
    peers = peers_of(tiny)
    add(
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
        add(
            f"{model} frame p50 at c=1 / in-process",
            d["edged"]["1"]["p50_ratio"],
            bound,
            "x",
            ", ".join(f"{LABEL[p]} {d[p]['1']['p50_ratio']:.2f}x" for p in peers),
            limit=_limit(d, "1", "p50_ratio"),
            worker_limit=_limit(d, "1", "p50_ratio", LIMIT_WORKER),
            twin=_limit(d, "1", "p50_ratio", TWIN),
        )
    for model, d in sv.items():
        best = max(peers, key=lambda p: d[p]["4"]["throughput_rps"])
        add(
            f"{model} throughput at c=4 / best peer ({LABEL[best]})",
            d["edged"]["4"]["throughput_rps"] / d[best]["4"]["throughput_rps"],
            1.5,
            "x",
            f"edged {d['edged']['4']['throughput_rps']:.0f}/s, {LABEL[best]} {d[best]['4']['throughput_rps']:.0f}/s",
            higher=True,
            limit=None if LIMIT not in d else d[LIMIT]["4"]["throughput_rps"] / d[best]["4"]["throughput_rps"],
            twin=None if TWIN not in d else d[TWIN]["4"]["throughput_rps"] / d[best]["4"]["throughput_rps"],
        )
    e = cold["edged"]
    for model in e["first_ms"]:
        add(
            f"first request / after the same idle gap, {model}",
            e["first_over_after_gap"][model],
            1.2,
            "x",
            f"first {e['first_ms'][model]:.3f} ms, after the gap {e['after_gap_ms'][model]:.3f} ms (medians)",
        )
    cases = r["scheduler"]["cases"]
    for base, batched in (("tiny_b1", "tiny_b16"), ("mlp2k_b1", "mlp2k_b16"), ("conv640_b1", "conv640_b8")):
        if f"{base}@c16" not in cases:
            continue
        # Batching never costs: at least the unbatched model's throughput (`bench batching` has
        # every concurrency and the c=1 latency, side by side).
        a, b = cases[f"{base}@c16"]["throughput_rps"], cases[f"{batched}@c16"]["throughput_rps"]
        add(f"dynamic batching at c=16, {batched} / {base}", b / a, 1.0, "x", f"{b:.0f}/s vs {a:.0f}/s", higher=True)
    add(
        "start → ready, 3 models, cache hit, less warm-up",
        e["ready_minus_warmup_s"],
        1.0,
        "s",
        f"ready {e['ready_s']:.2f} s incl. warm-up {e['warmup_s']:.2f} s",
    )
    return rows


# --- Markdown -----------------------------------------------------------------------------------


def _f(v: float, digits: int = 3) -> str:
    if v >= 100:
        return f"{v:.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.{digits}f}"


def markdown(r: dict[str, Any], pngs: Sequence[str], img_prefix: str = "") -> str:
    m = r["machine"]
    lines = [
        "# edged benchmark",
        "",
        f"Mode: {r['mode']}, {r['plan']['rounds']} interleaved rounds over "
        f"{r['plan'].get('serving_starts', 1)} start(s) of every server, {r['plan']['starts']} fresh starts "
        f"per server for the cold start; {r['elapsed_s'] / 60:.1f} min. Machine: {m['cpu']}, {m['cpus']} CPUs "
        f"(affinity {m['affinity']}), {m['memory_gib']} GiB, Linux {m['kernel']}, Python {m['python']}, "
        f"ONNX Runtime {m['onnxruntime']}; load average {m['loadavg_start'][0]:.2f} at start, "
        f"{m['loadavg_end'][0]:.2f} at end (the machine is shared).",
        "",
        "Figures are medians over the run; ratios (in brackets) are to the in-process floor measured in "
        "the same rounds. Latency is per request at a closed-loop concurrency c; throughput is requests/s.",
        "",
    ]
    lines += _setup(r)
    lines += _serving_table(r["serving"])
    lines += _cold_table(r["cold_summary"])
    lines += _sched_table(r["scheduler"])
    lines += [
        "## Targets",
        "",
        "| target | measured | bound | met | peers / detail |",
        "| --- | --- | --- | --- | --- |",
    ]
    for t in r["targets"]:
        bound = f"{'>=' if t['higher_is_better'] else '<='} {t['bound']} {t['unit']}"
        lines.append(
            f"| {t['target']} | {_f(t['value'])} {t['unit']} | {bound} | {'yes' if t['met'] else '**no**'} "
            f"| {t['peers']} |"
        )
    lines += [""] + [f"![{p}]({img_prefix}{p})" for p in pngs] + [""]
    return "\n".join(lines)


SETUP = {
    TWIN: "edged's daemon started a second time, the same code and configuration, measured in the same "
    "rounds: the spread of two daemons that should measure the same (where each one's threads land is fixed "
    "for its life), shown beside each of edged's targets",
    "edged": "`edged serve`, one instance per model, intra-op threads as listed, no batching (defaults); "
    "requests over its Unix socket with the binary tensor extension; frames through a registered "
    "sealed memfd region (mapped by the daemon, no copy); ready = sd_notify `READY=1` (after warm-up)",
    "fastapi": "uvicorn (uvloop, httptools) on a Unix socket, an `async def` endpoint taking the tensor's raw "
    "bytes, the ONNX Runtime session created on the first request (lazy); ready = `GET /health`",
    "pytriton": "nvidia-pytriton 0.7 (Triton's server binary; the callable runs an ONNX Runtime session in "
    "the Python process), batching on with the dynamic batcher (no queue delay; max batch 16 for "
    "tiny, 4 for frames); HTTP on 127.0.0.1 with the binary tensor extension; frames through "
    "system shared memory registered with tritonclient's utilities; ready = every model's "
    "`/v2/models/{m}/ready`",
    LIMIT: "the stack of edged and FastAPI (uvicorn, uvloop, httptools, a Unix socket) with each model run on "
    "its event loop, built as the floor's, on an input the server already holds, and a fixed 100-byte answer: "
    "the socket, HTTP and the run after a request's idle gap, nothing else (bench/limit.py). No server on this "
    "stack does better; where a target is past it, the machine cannot meet it",
    LIMIT_WORKER: "the limit with each run on a worker thread (asyncio's run_in_executor), the event loop free "
    "meanwhile: the bound for a server that may not block its loop for a run, as edged may not for a model "
    "over its inline threshold (the two thread wake-ups are the difference)",
    LIMIT_V2: "the least an Open Inference Protocol server does on this stack: edged's client's binary request "
    "read, decoded by edged's decoder (with its plan cache), the model run on the loop, the answer encoded by "
    "edged's encoder, nothing else (bench/limit.py: v2_app); where a target is past it, the protocol's own work "
    "puts the target out of reach on this stack. Beside tiny's target only: a frame in the body measures the "
    "socket's copy of it, which edged's clients avoid with shared memory",
}


def _setup(r: dict[str, Any]) -> list[str]:
    models = ", ".join(
        f"{n} ({'x'.join(map(str, m['shape']))}, {m['threads']} intra-op threads)" for n, m in r["models"].items()
    )
    lines = [
        "## Setup",
        "",
        f"Models: {models}; every server builds its sessions with the same options.",
        "The client is the same for every server: pre-encoded HTTP/1.1 requests on keep-alive "
        "connections, closed loop with c requests in flight; a frame is copied into the connection's "
        "region before each request, inside the timing. Each server runs with its own HOME and TMPDIR.",
        "",
    ]
    for name in ("edged", *peers_of(r["cold_start"])):
        cpus = sorted({c for p in r["cold_start"][name][0]["placement"].values() for c in p})
        lines.append(f"- **{LABEL[name]}**: {SETUP[name]}. CPU placement (sched_getaffinity, whole tree): {cpus}.")
    for extra in (TWIN, *LIMITS):
        if any(extra in lanes for lanes in r["serving"].values()):
            lines.append(f"- **{LABEL[extra]}** (serving only): {SETUP[extra]}.")
    return [*lines, ""]


def _serving_table(sv: dict[str, Any]) -> list[str]:
    lines = [
        "## Serving",
        "",
        "| model | server | transport | p50 c=1 ms | p99 c=1 ms | p50 c=4 ms | p99 c=4 ms "
        "| req/s c=1 | req/s c=4 | req/s c=16 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for model, targets in sv.items():
        for name in (
            FLOOR,
            "edged",
            *(n for n in (TWIN,) if n in targets),
            *peers_of(targets),
            *(n for n in LIMITS if n in targets),
        ):
            d = targets[name]
            lat = [
                f"{_f(d[c][k])} ({d[c][k.replace('_ms', '_ratio')]:.2f})" if name != FLOOR else _f(d[c][k])
                for c in ("1", "4")
                for k in ("p50_ms", "p99_ms")
            ]
            thr = [
                f"{d[c]['throughput_rps']:.0f} ({d[c]['throughput_ratio']:.2f})"
                if name != FLOOR
                else f"{d[c]['throughput_rps']:.0f}"
                for c in ("1", "4", "16")
            ]
            lines.append(f"| {model} | {LABEL[name]} | {TRANSPORT[name]} | " + " | ".join(lat + thr) + " |")
    return [*lines, ""]


def _cold_table(cold: dict[str, Any]) -> list[str]:
    models = list(cold["edged"]["first_ms"])
    head = " | ".join(f"{m}: first / steady / after gap ms" for m in models)
    per = cold["edged"]["after_gaps_per_start"]
    lines = [
        "## Cold start and memory",
        "",
        "Fresh process each start (a cache hit for edged); the first request per model comes after a "
        "0.5 s idle gap on a new connection, as do the after-gap requests on the server that has served"
        + (f" (the median of {per} per start). " if per > 1 else ". ")
        + "Memory is the whole process tree after all three models served.",
        "",
        f"| server | start → ready s | {head} | RSS MiB | PSS MiB | processes |",
        "| --- | --- | " + " | ".join("---" for _ in models) + " | --- | --- | --- |",
    ]
    for name in ("edged", *peers_of(cold)):
        c = cold[name]
        cells = [f"{_f(c['first_ms'][m])} / {_f(c['steady_ms'][m])} / {_f(c['after_gap_ms'][m])}" for m in models]
        ready = f"{c['ready_s']:.2f}" + (f" (warm-up {c['warmup_s']:.2f})" if "warmup_s" in c else "")
        lines.append(
            f"| {LABEL[name]} | {ready} | "
            + " | ".join(cells)
            + f" | {c['rss_mib']:.0f} | {c['pss_mib']:.0f} | {c['processes']} |"
        )
    return [*lines, ""]


def _sched_table(sched: dict[str, Any]) -> list[str]:
    lines = [
        "## edged's scheduler",
        "",
        "| case | settings | p50 ms | p99 ms | req/s |",
        "| --- | --- | --- | --- | --- |",
    ]
    for case, d in sched["cases"].items():
        name = case.split("@")[0]
        opts = ", ".join(f"{k}={v}" for k, v in sched["variants"][name].items()) or "defaults"
        lines.append(f"| {case} | {opts} | {_f(d['p50_ms'])} | {_f(d['p99_ms'])} | {d['throughput_rps']:.0f} |")
    return [*lines, ""]


# --- plots --------------------------------------------------------------------------------------


def plots(series: ServingSeries, r: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    return [
        _latency_plot(series, out / "bench_latency.png"),
        _throughput_plot(r, out / "bench_throughput.png"),
        _cold_plot(r, out / "bench_cold_start.png"),
    ]


COLORS = {FLOOR: "#555555", "edged": "#1f77b4", "fastapi": "#2ca02c", "pytriton": "#d62728"}


def _latency_plot(series: ServingSeries, path: Path) -> Path:
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import NullFormatter

    models = list(series)
    fig, axes = plt.subplots(2, len(models), figsize=(4.2 * len(models), 6.5), squeeze=False)
    for col, model in enumerate(models):
        for row, conc in enumerate((1, 4)):
            ax = axes[row][col]
            for name in (FLOOR, "edged", *peers_of(series[model])):
                ms = np.sort(np.asarray(series[model][name][conc].latencies) * 1000)
                if ms.size:
                    ax.plot(ms, np.linspace(0, 1, ms.size), label=LABEL[name], color=COLORS[name])
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_title(f"{model}, c={conc}", fontsize=10)
            ax.set_xlabel("latency (ms, log)")
            ax.grid(alpha=0.3)
            if col == 0:
                ax.set_ylabel("fraction of requests")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Latency distribution per server (CDF)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _throughput_plot(r: dict[str, Any], path: Path) -> Path:
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    sv = r["serving"]
    models = list(sv)
    names = (FLOOR, "edged", *peers_of(sv[models[0]]))
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6), squeeze=False)
    for col, model in enumerate(models):
        ax = axes[0][col]
        concs = list(sv[model][FLOOR])
        x = np.arange(len(concs))
        for i, name in enumerate(names):
            ax.bar(
                x + (i - (len(names) - 1) / 2) * 0.2,
                [sv[model][name][c]["throughput_rps"] for c in concs],
                0.2,
                label=LABEL[name],
                color=COLORS[name],
            )
        ax.set_xticks(x, [f"c={c}" for c in concs])
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_title(model, fontsize=10)
        ax.set_ylabel("requests/s (log)")
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _cold_plot(r: dict[str, Any], path: Path) -> Path:
    """One start per server (the first recorded): spawn → ready, edged's own phases, then each
    model's first request as a bar at its time."""
    import matplotlib.pyplot as plt

    names = ("edged", *peers_of(r["cold_start"]))
    fig, ax = plt.subplots(figsize=(9, 1.1 + 1.0 * len(names)))
    for row, name in enumerate(names):
        start = r["cold_start"][name][0]
        ready = start["ready_s"]
        ax.barh(row, ready, color=COLORS[name], alpha=0.35, height=0.6)
        ax.text(ready, row + 0.18, f" ready {ready:.2f} s", fontsize=7, va="center")
        for _model, phase, at in start.get("phases", []):
            if phase == "warming":
                ax.plot([at], [row], marker="|", color="black", markersize=12)
        for i, (label, at, dur) in enumerate(start["events"][1:]):
            ax.barh(row, max(dur, 0.006), left=at, color=COLORS[name], height=0.35)
            ax.text(at, row - 0.3 - 0.14 * (i % 2), f"{label.split()[1]} {dur * 1000:.1f} ms", fontsize=6.5)
    ax.set_yticks(range(len(names)), [LABEL[n] for n in names])
    ax.set_ylim(-0.8, len(names) - 0.4)
    ax.set_xlabel("seconds since the process was spawned")
    ax.set_title(
        "Cold start: spawn → ready (light bar; | edged warms a model), then each model's first request", fontsize=9
    )
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
