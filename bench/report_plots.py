"""The PNG plots of a peers run (bench/peers.py): each server's latency distribution, throughput
per concurrency and the cold-start timeline. matplotlib is imported only when they are drawn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.measure import FLOOR
from bench.report import LABEL, ServingSeries, peers_of


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
