"""Dynamic batching against none, side by side: c=1 latency and throughput at each concurrency.

    scripts/bench.sh batching [--rounds 7] [--concurrency 1,4,16] [--base COMMIT|FOLDER] [--out bench-results]

One daemon serves every model twice, under its own name: unbatched (the defaults) and batched
(``max_batch = 16`` and a 1 ms queue delay for tiny and mlp2k, ``max_batch = 8`` and 2 ms for
conv640, the peers benchmark's scheduler settings). Every (variant, concurrency) lane runs once per
round, a model's two variants at one concurrency back to back (in turns first), the pairs in a
rotating order; each round gives a throughput and a p50 per lane, and the report is the median
over the rounds of the batched lane's ratio to the unbatched one of the same round. ``--base``
adds a daemon of another commit serving the same variants in the same rounds (the batcher before
a change). The daemon's status for each variant (its batching decision and the runs it rests on,
its batch counts) is kept beside the figures in ``bench-results/batching.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.base_tree import BaseEdged
from bench.edged_server import EdgedServer, get_status
from bench.measure import Budget, server_runner
from bench.models import ModelSpec, batchable, make_conv640, session
from bench.peers import REPO, log, machine, running
from bench.servers import check

# model -> batched settings (the peers benchmark's scheduler phase)
BATCHED = {
    "tiny": {"max_batch": 16, "max_queue_delay_us": 1000},
    "mlp2k": {"max_batch": 16, "max_queue_delay_us": 1000},
    "conv640": {"max_batch": 8, "max_queue_delay_us": 2000},
}
BUDGETS = {"tiny": Budget(3000, 0.3), "mlp2k": Budget(1500, 0.3), "conv640": Budget(400, 0.5)}


def models(folder: Path) -> dict[str, ModelSpec]:
    """The three models, built here if missing (none needs a download)."""
    from edged.tools.demo import make_tiny_mlp

    tiny, conv = folder / "tiny.onnx", folder / "conv640.onnx"
    if not tiny.exists():
        make_tiny_mlp(tiny)
    if not conv.exists():
        make_conv640(conv)
    cores = len(os.sched_getaffinity(0))  # what edged picks for one instance (threads = 0)
    return {
        "tiny": ModelSpec("tiny", str(tiny.resolve()), "x", (1, 16), ("probs",), 1, False),
        "mlp2k": batchable(folder),
        "conv640": ModelSpec("conv640", str(conv.resolve()), "x", (1, 3, 640, 640), ("logits",), cores, True),
    }


def variants(specs: dict[str, ModelSpec]) -> tuple[dict[str, ModelSpec], dict[str, dict[str, Any]]]:
    """Each model unbatched (``NAME_b1``) and batched (``NAME_bN``), as the daemon names them."""
    out, options = {}, {}
    for name, batched in BATCHED.items():
        spec = specs[name]
        for suffix, opts in (("b1", {}), (f"b{batched['max_batch']}", batched)):
            out[f"{name}_{suffix}"] = dataclasses.replace(spec, name=f"{name}_{suffix}")
            options[f"{name}_{suffix}"] = opts
    return out, options


def rounds(servers: list[EdgedServer], concurrencies: list[int], n: int) -> dict[str, Any]:
    """Per (server, variant, concurrency): each round's throughput and p50 (ms). A model's two
    variants at one concurrency run back to back, in turns first, so that each round's ratio
    compares lanes that met the same moment of a shared machine; the pairs rotate between rounds."""
    lanes, pairs = {}, []
    for server in servers:
        for model, batched in BATCHED.items():
            names = (f"{model}_b1", f"{model}_b{batched['max_batch']}")
            for name in names:
                spec = server.specs[name]
                x = spec.sample()
                check(server, spec, x, session(spec).run([spec.outputs[0]], {spec.input: x})[0])
                for c in concurrencies:
                    lanes[(server.name, name, c)] = (server_runner(server, spec, x, c), BUDGETS[model])
            pairs += [tuple((server.name, name, c) for name in names) for c in concurrencies]
    for run, budget in lanes.values():  # warm every lane once, unrecorded
        run(max(1, budget.requests // 10), budget.seconds / 4)
    out: dict[str, Any] = {}
    for r in range(n):
        log(f"round {r + 1} of {n}")
        for pair in pairs[r % len(pairs) :] + pairs[: r % len(pairs)]:
            for key in pair if r % 2 == 0 else pair[::-1]:
                run, budget = lanes[key]
                lat, wall = run(budget.requests, budget.seconds)
                lane = out.setdefault("/".join(map(str, key)), {"rps": [], "p50_ms": []})
                lane["rps"].append(len(lat) / wall if wall > 0 else 0.0)
                lane["p50_ms"].append(float(np.percentile(np.asarray(lat) * 1000, 50)) if lat else 0.0)
    return out


def ratios(lanes: dict[str, Any], server: str, concurrencies: list[int]) -> list[dict[str, Any]]:
    """Batched over unbatched, round by round, for one server: the median and the worst round."""
    rows = []
    for model, batched in BATCHED.items():
        b1, bn = f"{model}_b1", f"{model}_b{batched['max_batch']}"
        for c in concurrencies:
            one, many = lanes[f"{server}/{b1}/{c}"], lanes[f"{server}/{bn}/{c}"]
            rps = [m / o for m, o in zip(many["rps"], one["rps"]) if o]
            p50 = [m / o for m, o in zip(many["p50_ms"], one["p50_ms"]) if o]
            rows.append(
                {
                    "server": server,
                    "model": model,
                    "c": c,
                    "unbatched_rps": statistics.median(one["rps"]),
                    "batched_rps": statistics.median(many["rps"]),
                    "throughput_ratio": statistics.median(rps),
                    "throughput_ratio_worst": min(rps),
                    "unbatched_p50_ms": statistics.median(one["p50_ms"]),
                    "batched_p50_ms": statistics.median(many["p50_ms"]),
                    "p50_ratio": statistics.median(p50),
                }
            )
    return rows


def markdown(rows: list[dict[str, Any]], status: dict[str, Any]) -> str:
    lines = [
        "| server | model | c | unbatched req/s | batched req/s | batched / unbatched (worst round) "
        "| p50 unbatched / batched ms | p50 ratio |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['server']} | {r['model']} | {r['c']} | {r['unbatched_rps']:.0f} | {r['batched_rps']:.0f} "
            f"| {r['throughput_ratio']:.3f}x ({r['throughput_ratio_worst']:.3f}x) "
            f"| {r['unbatched_p50_ms']:.3f} / {r['batched_p50_ms']:.3f} | {r['p50_ratio']:.3f}x |"
        )
    lines += ["", "| server | variant | batching | inline | batches / rows / waits |"]
    lines += ["| --- | --- | --- | --- | --- |"]
    for server, models in status.items():
        for name, m in models.items():
            fit = m.get("batching") or {}
            what = f"{'on' if fit.get('on') else 'off'}, rows {fit.get('rows')}: {fit.get('reason', '-')}"
            counts = f"{m.get('batches')} / {m.get('rows')} / {m.get('batch_waits', '-')}"
            lines.append(f"| {server} | {name} | {what} | {m.get('inline')} | {counts} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--base", default=None, help="also run edged of this commit (or folder holding edged/)")
    ap.add_argument("--out", default=str(REPO / "bench-results"))
    args = ap.parse_args(argv)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    started = time.monotonic()
    vspecs, options = variants(models(REPO / "data" / "bench"))
    with tempfile.TemporaryDirectory(prefix="edged-batching-") as tmp:
        work = Path(tmp)
        servers: list[EdgedServer] = [EdgedServer(work, vspecs, options)]
        if args.base is not None:
            servers.append(BaseEdged(work, vspecs, args.base, options=options))
        with running(list(servers)):
            lanes = rounds(servers, concurrencies, args.rounds)
            status = {s.name: get_status(s.addr)["models"] for s in servers}
            for s in servers:
                s.close_frames()
    rows = [row for s in servers for row in ratios(lanes, s.name, concurrencies)]
    result = {
        "machine": machine(),
        "rounds": args.rounds,
        "variants": options,
        "ratios": rows,
        "lanes": lanes,
        "status": status,
        "elapsed_s": time.monotonic() - started,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "batching.json").write_text(json.dumps(result, indent=1))
    text = markdown(rows, status)
    (out / "batching.md").write_text(text)
    print(text)
    log(f"report in {out}/batching.{{json,md}}; the run took {result['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
