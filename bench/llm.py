"""A language model served by edged against llama.cpp's own server (``llama-server``, built from the
llama.cpp that the pinned llama-cpp-python vendors: bench/llama_server.py) and llama-cpp-python's
OpenAI server (``python -m llama_cpp.server``), with llama.cpp in process as the floor.

Same GGUF (SmolLM2-135M-Instruct Q4_1), same chat: a shared system prompt of about 300 tokens and a
distinct user turn per request, through ``/v1/chat/completions``, so that each server applies the
model's chat template as its clients would have it do (the prompt tokens each server reports are
kept in the results: they match when the templates render alike). Every server gets all cores and
four concurrent sequences where it has them: llama-server ``-np 4 -c 8192`` (its context is split
among the slots), edged ``slots = 4, context = 2048`` with the system prompt as its
``system_prompt``; llama_cpp.server has one sequence and queues the rest.

Interleaved, since the machines are shared and their load drifts: each round starts the servers one
after the other (the order rotating between rounds) and keeps them all running, then makes every
measurement server by server, one request or one burst at a time, the in-process floor's one-stream
decodes among them; then stops them all and starts edged once more on the cache it left.

Measured per server: start → ready (spawn to its health endpoint answering 200); the first
streamed request's time to first token (TTFT: to the first chunk with content); TTFT p50/p95 idle
(one request at a time) and under 4-way load (four clients at once, each sending requests back to
back); TTFT of a system prompt
that differs by its first word (nothing reused: the prefill's cost); aggregate decode tokens/s of
1, 2 and 4 concurrent streams of 64 new tokens, greedy, counting the tokens each server reports in
``usage`` (or its content chunks where its stream has no usage); RSS and PSS of the process tree
after the load. For edged also a restart with the engine cache kept (the system prompt's state
saved by the first start): start → ready and the first TTFT against the first start's with an
empty cache. In process: llama-cpp-python's ``Llama``, one sequence, one stream's tokens/s.

    .venv/bin/pip install -c scripts/constraints.txt 'llama-cpp-python[server]'   # the peer's extra
    .venv/bin/python -m bench.llm data/models/smollm2.gguf [--rounds 2] [--out bench-results/llm.json]

The first run builds llama-server (minutes, once per llama-cpp-python version; ``--llama-src``
takes an unpacked sdist instead of fetching it with pip); a peer that cannot run here is left out
with the reason printed and kept in the results.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import llama_server
from bench.llm_floor import Floor
from bench.llm_measure import Counter, measure_restart, run_round
from bench.llm_report import markdown, ratios, restart_summary, summarise, target_lines, targets
from bench.llm_servers import EdgedLlm, LazyServer, LlamaCppPythonServer, LlamaServer, LlmTarget
from bench.llm_workload import CONTEXT, CORES, DECODE_TOKENS, SLOTS

REPO = Path(__file__).resolve().parent.parent


# --- the run ----------------------------------------------------------------------------------


def keep_logs(work: Path, dest: Path) -> None:
    """The servers' logs next to the results: what a surprising figure is checked against."""
    for log in work.glob("*/server.log"):
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy2(log, dest / f"{log.parent.name}.log")


def peers_available(args: argparse.Namespace) -> tuple[dict[str, str], Path | None]:
    """Which peers can run here, and why not for those that cannot."""
    skipped: dict[str, str] = {}
    binary: Path | None = None
    if "llama-server" in args.servers:
        try:
            binary = args.llama_server or llama_server.binary(args.llama_src)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            skipped["llama-server"] = f"cannot build llama-server: {e.__class__.__name__}: {e}"
    if "llama_cpp.server" in args.servers:
        try:
            import llama_cpp.server.app  # noqa: F401
        except ImportError as e:
            skipped["llama_cpp.server"] = f"llama-cpp-python's server extra is not installed ({e})"
    return skipped, binary


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, with ``--servers`` split into a list."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("model", type=Path)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steady", type=int, default=12, help="idle TTFT requests per server and round")
    ap.add_argument("--load", type=int, default=2, help="bursts of the 4-way load per server and round")
    ap.add_argument("--cold", type=int, default=2, help="requests with nothing reused per server and round")
    ap.add_argument(
        "--servers",
        default="edged,llama-server,llama_cpp.server,in-process",
        help="comma-separated, of edged, llama-server, llama_cpp.server, lazy (the lazy wrapper), in-process",
    )
    ap.add_argument("--llama-server", type=Path, help="a llama-server binary to use instead of the cached build")
    ap.add_argument("--llama-src", type=Path, help="an unpacked llama-cpp-python sdist to build llama-server from")
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "llm.json")
    args = ap.parse_args(argv)
    args.servers = args.servers.split(",")
    return args


def _round_servers(
    args: argparse.Namespace, r: int, work: Path, model: Path, cache: Path, binary: Path | None, skipped: dict[str, str]
) -> list[LlmTarget]:
    """The servers of round ``r``, their order rotated by ``r``."""
    servers: list[LlmTarget] = []
    if "edged" in args.servers:
        servers.append(EdgedLlm(work, model, cache))
    if binary is not None:
        servers.append(LlamaServer(work, model, binary))
    if "llama_cpp.server" in args.servers and "llama_cpp.server" not in skipped:
        servers.append(LlamaCppPythonServer(work, model))
    if "lazy" in args.servers:
        servers.append(LazyServer(work, model))
    return servers[r % len(servers) :] + servers[: r % len(servers)] if servers else []


def _one_round(
    args: argparse.Namespace,
    r: int,
    model: Path,
    binary: Path | None,
    skipped: dict[str, str],
    n: Counter,
    failures: dict[str, list[str]],
    logs: Path,
) -> dict[str, dict[str, Any]]:
    """Round ``r`` in a work directory of its own: every server measured, then edged restarted on
    the cache it left; the figures by server, the servers' logs kept under ``logs``."""
    work = Path(tempfile.mkdtemp(prefix="edged-llm-bench-"))
    cache = work / "cache"  # empty: edged's first start prefills the system prompt and saves it
    servers = _round_servers(args, r, work, model, cache, binary, skipped)
    floor = Floor(model) if "in-process" in args.servers else None
    try:
        res = run_round(servers, floor, n, args, failures)
        if "edged" in res:  # again on the cache it left, the others stopped
            try:
                res["edged restarted"] = measure_restart(
                    EdgedLlm(work, model, cache, "edged restarted"), n, args.steady
                )
            except RuntimeError as e:
                failures.setdefault("edged restarted", []).append(str(e))
    finally:
        if floor is not None:
            floor.close()
        keep_logs(work, logs / f"round{r + 1}")
        shutil.rmtree(work, ignore_errors=True)
    return res


def _setup(model: Path, binary: Path | None, load_start: tuple[float, float, float]) -> dict[str, Any]:
    """What the run was made with, for the results."""
    return {
        "model": str(model),
        "cores": CORES,
        "slots": SLOTS,
        "context_per_sequence": CONTEXT,
        "decode_tokens": DECODE_TOKENS,
        "llama_server": str(binary) if binary else None,
        "llama_cpp_python": llama_server.version(),
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
    }


def _print_report(
    table: dict[str, dict[str, Any]],
    restart: dict[str, Any],
    rows: list[dict[str, Any]],
    skipped: dict[str, str],
    failures: dict[str, list[str]],
    out: Path,
    logs: Path,
) -> None:
    """The table, the ratios, edged's restart, the targets and what was left out or failed."""
    print(markdown(table))
    print()
    print(ratios(table))
    if restart:
        print()
        print(
            f"edged restart with the cache kept: start → ready {restart['start_to_ready_s']:.2f} s "
            f"(empty cache {restart['empty_cache_start_to_ready_s']:.2f} s), first TTFT "
            f"{restart['first_ttft_ms']:.0f} ms (empty cache {restart['empty_cache_first_ttft_ms']:.0f} ms), "
            f"steady {restart['steady_ttft_ms']:.0f} ms, nothing reused {restart['prefill_ttft_ms']:.0f} ms"
        )
    print()
    print(target_lines(rows))
    for name, row in table.items():
        if row.get("tokens_from_usage") is False:
            print(f"{name}: tokens counted as content chunks (its stream carries no usage)")
    for name, why in skipped.items():
        print(f"left out: {name}: {why}")
    for name, errors in failures.items():
        print(f"failed: {name}: {len(errors)} run(s): {errors[0][:600]}")
    print(f"results: {out} (servers' logs in {logs})")


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    model = args.model.resolve()
    skipped, binary = peers_available(args)
    for name, why in skipped.items():
        print(f"left out: {name}: {why}", file=sys.stderr)

    # A SIGTERM (a timeout's) unwinds like Ctrl-C, so that every server started is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logs = args.out.with_name(args.out.stem + "-logs")
    shutil.rmtree(logs, ignore_errors=True)
    load_start = os.getloadavg()
    failures: dict[str, list[str]] = {}
    n = Counter()
    runs: dict[str, list[dict[str, Any]]] = {}
    for r in range(args.rounds):
        res = _one_round(args, r, model, binary, skipped, n, failures, logs)
        for name, figures in res.items():
            runs.setdefault(name, []).append(figures)
            brief = {k: v for k, v in figures.items() if not k.endswith(("_ttft_s", "_tokens")) and k != "restored"}
            print(f"round {r + 1}: {name}: {json.dumps(brief)}", file=sys.stderr)
    table = summarise({k: v for k, v in runs.items() if k != "edged restarted"})
    restart = restart_summary(runs)
    rows = targets(table, restart)
    result = {
        "table": table,
        "restart": restart,
        "targets": rows,
        "skipped": skipped,
        "failures": failures,
        "runs": runs,
        "setup": _setup(model, binary, load_start),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    _print_report(table, restart, rows, skipped, failures, args.out, logs)


if __name__ == "__main__":
    main()
