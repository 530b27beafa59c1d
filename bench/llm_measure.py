"""The measurements of the language-model benchmark (bench/llm.py): one round of servers started
in turn and measured interleaved (TTFT idle, with nothing reused and under load, tokens/s of
concurrent streams, memory), edged started again on the engine cache it left, and what edged's
log says about its warm-up and the system prompt it restored.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.llm_floor import Floor
from bench.llm_servers import EdgedLlm, LlmTarget
from bench.llm_stream import (
    Stream,
    aggregate_tps,
    concurrent,
    httpx,  # the one HTTP client the benchmark uses (see there)
    stream_chat,
)
from bench.llm_workload import (
    DECODE_TOKENS,
    LOAD_PER_CLIENT,
    READY_TIMEOUT_S,
    SLOTS,
    STREAMS,
    SYSTEM,
    TTFT_TOKENS,
    chat,
    cold_system,
    decode_turn,
    user_turn,
)
from bench.servers import Server


class Counter:
    """Distinct request numbers across a run: no two requests share a user turn."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> int:
        self.n += 1
        return self.n


def state(srv: Server) -> str:
    """Whether the server was still running when a measurement failed, and its log's end."""
    if srv.proc is None or srv.proc.poll() is None:
        return "the server was still running"
    return f"the server had exited with {srv.proc.returncode}; its log ends: {srv.log_tail(600)!r}"


@dataclass
class Round:
    """One round: every server started in turn and kept running, then each measurement made
    server by server, one request (or one burst) at a time, so that a change in the machine's
    load falls on all of them alike."""

    live: list[LlmTarget]
    n: Counter
    failures: dict[str, list[str]]
    out: dict[str, dict[str, Any]]

    def each(self, step: Callable[[LlmTarget, dict[str, Any]], None]) -> None:
        """``step`` on every live server; a server that fails is stopped, reported and dropped
        from the round (its partial figures with it)."""
        for srv in list(self.live):
            try:
                step(srv, self.out[srv.name])
            except (RuntimeError, httpx.HTTPError, OSError) as e:
                self.fail(srv, e)

    def fail(self, srv: LlmTarget, e: Exception) -> None:
        self.failures.setdefault(srv.name, []).append(f"{e.__class__.__name__}: {e}; {state(srv)}")
        print(f"{srv.name} FAILED: {e}", file=sys.stderr)
        srv.stop()
        self.live.remove(srv)
        del self.out[srv.name]

    def ttft(self, key: str, system: Callable[[], str] = lambda: SYSTEM) -> None:
        def step(srv: LlmTarget, out: dict[str, Any]) -> None:
            with srv.client() as c:
                s = stream_chat(c, chat(user_turn(self.n()), system()), TTFT_TOKENS)
            out.setdefault(key, []).append(s.ttft)
            out.setdefault(key.replace("ttft_s", "prompt_tokens"), []).append(s.prompt_tokens)

        self.each(step)

    def decode(self, k: int) -> None:
        def step(srv: LlmTarget, out: dict[str, Any]) -> None:
            turns = [self.n() for _ in range(k)]

            def one(c: httpx.Client, j: int) -> list[Stream]:
                return [stream_chat(c, chat(decode_turn(turns[j])), DECODE_TOKENS)]

            streams = concurrent(srv.client, k, one)
            out.setdefault("tps", {}).setdefault(str(k), []).append(aggregate_tps(streams))
            out.setdefault("decode_tokens", {}).setdefault(str(k), []).append([s.tokens for s in streams])
            out["tokens_from_usage"] = out.get("tokens_from_usage", True) and all(s.from_usage for s in streams)

        self.each(step)

    def load(self, per_client: int) -> None:
        """``SLOTS`` clients at once, each sending ``per_client`` requests back to back."""

        def step(srv: LlmTarget, out: dict[str, Any]) -> None:
            def busy(c: httpx.Client, j: int) -> list[Stream]:
                return [stream_chat(c, chat(user_turn(self.n())), DECODE_TOKENS // 2) for _ in range(per_client)]

            out.setdefault("load_ttft_s", []).extend(s.ttft for s in concurrent(srv.client, SLOTS, busy))

        self.each(step)


def run_round(
    servers: list[LlmTarget], floor: Floor | None, n: Counter, args: argparse.Namespace, failures: dict[str, list[str]]
) -> dict[str, dict[str, Any]]:
    """Start every server, measure them interleaved, stop them; the figures by server."""
    rnd = Round([], n, failures, {s.name: {} for s in servers})

    def start(srv: LlmTarget, out: dict[str, Any]) -> None:
        srv.start()
        out["start_to_ready_s"] = srv.wait_ready(READY_TIMEOUT_S)
        with srv.client() as c:
            first = stream_chat(c, chat(user_turn(n())), TTFT_TOKENS)
        out["first_ttft_s"], out["prompt_tokens"] = first.ttft, first.prompt_tokens

    try:
        for srv in servers:  # one at a time, as each would start alone; the others wait idle
            rnd.live.append(srv)
            try:
                start(srv, rnd.out[srv.name])
            except (RuntimeError, httpx.HTTPError, OSError) as e:
                rnd.fail(srv, e)
        for _ in range(args.steady):
            rnd.ttft("idle_ttft_s")
        for _ in range(args.cold):
            rnd.ttft("prefill_ttft_s", lambda: cold_system(n()))
        floor_out: dict[str, Any] = {}
        for k in STREAMS:
            for _ in range(2 if k == 1 else 1):  # one stream is the noisiest figure: two of them
                rnd.decode(k)
                if k == 1 and floor is not None:
                    rate, made = floor.decode(n())
                    floor_out.setdefault("tps", {}).setdefault("1", []).append(rate)
                    floor_out.setdefault("decode_tokens", {}).setdefault("1", []).append([made])
        for _ in range(args.load):
            rnd.load(LOAD_PER_CLIENT)

        def memory(srv: LlmTarget, out: dict[str, Any]) -> None:
            out["memory"] = srv.memory()

        rnd.each(memory)
        if floor is not None:
            rnd.out[floor.name] = dict(floor_out, load_s=floor.load_s)
    finally:
        for srv in rnd.live:  # each one, even when stopping another failed
            try:
                srv.stop()
            except (OSError, subprocess.SubprocessError) as e:
                print(f"stopping {srv.name}: {e!r}", file=sys.stderr)
    for srv in servers:
        if isinstance(srv, EdgedLlm) and srv.name in rnd.out:
            rnd.out[srv.name]["warmup_s"] = warmup_seconds(srv.dir / "server.log")
    return rnd.out


def measure_restart(srv: EdgedLlm, n: Counter, steady: int) -> dict[str, Any]:
    """edged again on the cache its first start left: the saved system prompt is restored."""
    out: dict[str, Any] = {}
    srv.start()
    try:
        out["start_to_ready_s"] = srv.wait_ready(READY_TIMEOUT_S)
        with srv.client() as c:
            out["first_ttft_s"] = stream_chat(c, chat(user_turn(n())), TTFT_TOKENS).ttft
            out["idle_ttft_s"] = [stream_chat(c, chat(user_turn(n())), TTFT_TOKENS).ttft for _ in range(steady)]
    except (RuntimeError, httpx.HTTPError, OSError) as e:
        raise RuntimeError(f"{srv.name}: {e.__class__.__name__}: {e}; {state(srv)}") from e
    finally:
        srv.stop()
    out["restored"] = restored_lines(srv.dir / "server.log")
    out["warmup_s"] = warmup_seconds(srv.dir / "server.log")
    return out


def warmup_seconds(log: Path) -> float:
    """From the model's warm-up starting to its being ready, by edged's log (-1 if not found):
    how much of start → ready the warm-up takes."""
    stamps: dict[str, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        for phase in ("warming", "ready"):
            if f"phase={phase}" in line and phase not in stamps:
                with contextlib.suppress(ValueError):
                    stamps[phase] = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return stamps["ready"] - stamps["warming"] if len(stamps) == 2 else -1.0


def restored_lines(log: Path) -> list[str]:
    """What edged's log says it restored (or prefilled) for the system prompt."""
    keys = ("restored a prefix", "system prompt prefilled", "saved prefixes restored", "failed its check")
    lines = log.read_text(errors="replace").splitlines()
    return [line.split("engine: ", 1)[-1].strip() for line in lines if any(k in line for k in keys)]
