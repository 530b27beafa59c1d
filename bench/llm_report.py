"""The results of the language-model benchmark (bench/llm.py) made readable: each server's runs
reduced to medians and percentiles, the Markdown table and edged's ratios to a peer, edged's
restart on its saved cache, and the project's targets with whether each was met.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from typing import Any

from bench.llm_workload import STREAMS


def pct(values: list[float], q: float) -> float:
    """The q-quantile by nearest rank (small samples: p95 of 12 is the 12th)."""
    s = sorted(values)
    return s[max(0, min(len(s) - 1, int(-(-q * len(s) // 1)) - 1))]


def med(values: Iterator[float] | list[float]) -> float:
    return float(statistics.median(list(values)))


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    table: dict[str, dict[str, Any]] = {}
    for name, rs in runs.items():
        if not rs:
            continue
        row: dict[str, Any] = {}
        for k in STREAMS:
            values = [v for r in rs for v in r["tps"].get(str(k), [])]
            if values:
                row[f"tps_{k}"] = med(values)
        if "start_to_ready_s" in rs[0]:
            idle = [t * 1e3 for r in rs for t in r["idle_ttft_s"]]
            row["start_to_ready_s"] = med(r["start_to_ready_s"] for r in rs)
            row["first_ttft_ms"] = med(r["first_ttft_s"] * 1e3 for r in rs)
            row["idle_ttft_p50_ms"] = med(idle)
            row["idle_ttft_p95_ms"] = pct(idle, 0.95)
        if "load_ttft_s" in rs[0]:
            load = [t * 1e3 for r in rs for t in r["load_ttft_s"]]
            prefill = [t * 1e3 for r in rs for t in r["prefill_ttft_s"]]
            row["load_ttft_p50_ms"] = med(load)
            row["load_ttft_p95_ms"] = pct(load, 0.95)
            row["prefill_ttft_ms"] = med(prefill)
            row["prompt_tokens"] = rs[0]["prompt_tokens"]
            row["prefill_prompt_tokens"] = rs[0]["prefill_prompt_tokens"][0]
            row["rss_mib"] = max(r["memory"]["rss_mib"] for r in rs)
            row["pss_mib"] = max(r["memory"]["pss_mib"] for r in rs)
            row["tokens_from_usage"] = all(r["tokens_from_usage"] for r in rs)
        if "load_s" in rs[0]:
            row["load_s"] = med(r["load_s"] for r in rs)
        table[name] = row
    return table


COLUMNS = [
    ("start_to_ready_s", "start→ready s", "{:.2f}"),
    ("first_ttft_ms", "first TTFT ms", "{:.0f}"),
    ("idle_ttft_p50_ms", "TTFT idle p50", "{:.0f}"),
    ("idle_ttft_p95_ms", "p95", "{:.0f}"),
    ("load_ttft_p50_ms", "TTFT 4-way p50", "{:.0f}"),
    ("load_ttft_p95_ms", "p95", "{:.0f}"),
    ("prefill_ttft_ms", "TTFT nothing reused", "{:.0f}"),
    ("tps_1", "tok/s ×1", "{:.1f}"),
    ("tps_2", "tok/s ×2", "{:.1f}"),
    ("tps_4", "tok/s ×4", "{:.1f}"),
    ("rss_mib", "RSS MiB", "{:.0f}"),
    ("pss_mib", "PSS MiB", "{:.0f}"),
]


def markdown(table: dict[str, dict[str, Any]]) -> str:
    lines = ["| server | " + " | ".join(c[1] for c in COLUMNS) + " |", "|" + " --- |" * (len(COLUMNS) + 1)]
    for name, row in table.items():
        cells = [c[2].format(row[c[0]]) if c[0] in row else "-" for c in COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratios(table: dict[str, dict[str, Any]], peer: str = "llama-server") -> str:
    """edged's figures over the peer's, column by column (tokens/s: higher is better; times
    and memory: lower is better)."""
    if "edged" not in table or peer not in table:
        return f"(no ratios: edged or {peer} did not run)"
    e, p = table["edged"], table[peer]
    lines = [f"| edged / {peer} | " + " | ".join(c[1] for c in COLUMNS) + " |", "|" + " --- |" * (len(COLUMNS) + 1)]
    cells = [f"{e[k] / p[k]:.2f}x" if k in e and k in p and p[k] else "-" for k, _, _ in COLUMNS]
    lines.append("| ratio | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets(table: dict[str, dict[str, Any]], restart: dict[str, Any]) -> list[dict[str, Any]]:
    """The project's targets, each with its figure, its bound and whether it was met."""
    rows: list[dict[str, Any]] = []

    def add(what: str, value: float, bound: float, unit: str, detail: str, higher: bool = False) -> None:
        met = value >= bound if higher else value <= bound
        rows.append({"target": what, "value": value, "bound": bound, "unit": unit, "met": met, "detail": detail})

    e, ls = table.get("edged"), table.get("llama-server")
    if e is not None and ls is not None:
        for k in (1, 4):
            a, b = e[f"tps_{k}"], ls[f"tps_{k}"]
            add(
                f"tokens/s at {k} stream(s) / llama-server",
                a / b,
                0.9,
                "x",
                f"edged {a:.1f}, llama-server {b:.1f}",
                True,
            )
    floor = table.get("in process (floor)")
    if e is not None and floor is not None:
        a, b = e["tps_1"], floor["tps_1"]
        add("one stream / llama.cpp in process", a / b, 0.9, "x", f"edged {a:.1f}, in process {b:.1f} tok/s", True)
    if e is not None:
        a, b = e["load_ttft_p95_ms"], e["idle_ttft_p95_ms"]
        add("TTFT p95 under 4-way load / idle", a / b, 2.0, "x", f"{a:.0f} ms vs {b:.0f} ms")
    if restart:
        add("start → ready with the saved state", restart["start_to_ready_s"], 3.0, "s", restart["detail"])
        add(
            "first TTFT after a restart / steady",
            restart["first_over_steady"],
            1.2,
            "x",
            f"{restart['first_ttft_ms']:.0f} ms vs steady p50 {restart['steady_ttft_ms']:.0f} ms",
        )
        add(
            "prefill of the system prompt / first TTFT after a restart",
            restart["prefill_over_first"],
            5.0,
            "x",
            f"{restart['prefill_ttft_ms']:.0f} ms with nothing reused vs {restart['first_ttft_ms']:.0f} ms",
            True,
        )
    return rows


def restart_summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """edged's second start on the first start's cache against that first start."""
    firsts, seconds = runs.get("edged", []), runs.get("edged restarted", [])
    if not firsts or not seconds:
        return {}
    steady = med(t * 1e3 for r in firsts + seconds for t in r["idle_ttft_s"])
    first = med(r["first_ttft_s"] * 1e3 for r in seconds)
    prefill = med(t * 1e3 for r in firsts for t in r["prefill_ttft_s"])
    empty = med(r["start_to_ready_s"] for r in firsts)
    kept = med(r["start_to_ready_s"] for r in seconds)
    return {
        "start_to_ready_s": kept,
        "empty_cache_start_to_ready_s": empty,
        "first_ttft_ms": first,
        "empty_cache_first_ttft_ms": med(r["first_ttft_s"] * 1e3 for r in firsts),
        "steady_ttft_ms": steady,
        "prefill_ttft_ms": prefill,
        "first_over_steady": first / steady,
        "prefill_over_first": prefill / first,
        "warmup_s": med(r.get("warmup_s", -1.0) for r in seconds),
        "empty_cache_warmup_s": med(r.get("warmup_s", -1.0) for r in firsts),
        "detail": f"{kept:.2f} s; {empty:.2f} s with an empty cache; the model's warm-up "
        f"{med(r.get('warmup_s', -1.0) for r in seconds):.2f} s of it",
    }


def target_lines(rows: list[dict[str, Any]]) -> str:
    out = []
    for r in rows:
        bound = ("≥ " if r["target"].startswith(("tokens", "one", "prefill")) else "≤ ") + f"{r['bound']:g} {r['unit']}"
        mark = "met" if r["met"] else "MISSED"
        out.append(f"- {mark}: {r['target']}: {r['value']:.2f} {r['unit']} (target {bound}; {r['detail']})")
    return "\n".join(out)
