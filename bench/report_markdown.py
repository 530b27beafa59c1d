"""The Markdown report of a peers run (bench/peers.py): the setup of every server, the serving
table with ratios to the in-process floor, cold start and memory, edged's scheduler cases and the
targets, with the PNG plots linked at the end."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.measure import FLOOR
from bench.report import LABEL, LIMIT, LIMIT_V2, LIMIT_WORKER, LIMITS, TRANSPORT, TWIN, fmt, peers_of


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
            f"| {t['target']} | {fmt(t['value'])} {t['unit']} | {bound} | {'yes' if t['met'] else '**no**'} "
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
                f"{fmt(d[c][k])} ({d[c][k.replace('_ms', '_ratio')]:.2f})" if name != FLOOR else fmt(d[c][k])
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
        cells = [f"{fmt(c['first_ms'][m])} / {fmt(c['steady_ms'][m])} / {fmt(c['after_gap_ms'][m])}" for m in models]
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
        lines.append(f"| {case} | {opts} | {fmt(d['p50_ms'])} | {fmt(d['p99_ms'])} | {d['throughput_rps']:.0f} |")
    return [*lines, ""]
