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
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, cast

try:  # the HTTP client that the openai package itself uses (httpx2 from openai 3 on)
    import httpx2 as httpx
except ImportError:  # pragma: no cover - older openai releases
    import httpx  # type: ignore[no-redef]

from bench import llama_server
from bench.servers import Server
from bench.wire import Address, connect

REPO = Path(__file__).resolve().parent.parent
CORES = len(os.sched_getaffinity(0))
MODEL = "llm"
CONTEXT = 2048  # per sequence
SLOTS = 4
DECODE_TOKENS = 64
TTFT_TOKENS = 4  # a TTFT request needs its first token only; a few more keep it a real stream
STREAMS = (1, 2, 4)
LOAD_PER_CLIENT = 2  # requests each of the four load clients sends back to back
READY_TIMEOUT_S = 300.0

SYSTEM = (
    "You are the maintenance assistant of a packaging plant, running on a small computer beside "
    "the line. Operators and technicians ask you about the machines: filler, capper, labeller, "
    "case packer, palletiser and the conveyors between them. Answer in plain English, in short "
    "sentences, and put the most important action first. When a question is about safety, say "
    "so at the start and tell the person to follow the lockout procedure before touching any "
    "moving part. Never guess a part number, a torque value or a setting that you were not given: "
    "say that it must be checked in the machine's manual. Each station logs temperature, vibration "
    "and motor current once a second; a slow rise in vibration usually means a worn bearing or a "
    "loose belt, a current spike usually means a jam, and a temperature well above the weekly mean "
    "usually means poor cooling or a failing motor. The night shift changes at ten in the evening "
    "and the day shift at six in the morning; planned stops are on Tuesday and Friday afternoons. "
    "Spare belts, bearings and fuses are kept in the store next to station four, and the store "
    "keeper records every part taken. If a technician reports a fault that has happened three "
    "times in one week, advise opening a maintenance ticket so that the cause is found rather "
    "than cleared again. Keep every answer under one hundred words unless a longer list is asked "
    "for, and end with the one thing to check first."
)

STATIONS = ("filler", "capper", "labeller", "case packer", "palletiser", "infeed conveyor", "outfeed conveyor")


def user_turn(i: int) -> str:
    """A distinct question per request: its tokens, after the shared system prompt, are new."""
    station = STATIONS[i % len(STATIONS)]
    return (
        f"Ticket {i}: the {station} at station {i % 11 + 1} showed a vibration rise of {i % 7 + 2} percent "
        f"since {i % 12 + 1} o'clock and a current spike at {i % 60:02d} minutes past. What should I check first?"
    )


def decode_turn(i: int) -> str:
    """A question a small model answers at length: decode speed."""
    station = STATIONS[i % len(STATIONS)]
    return f"Request {i}: write a numbered checklist of twenty steps for the weekly inspection of the {station}."


def cold_system(n: int) -> str:
    """The system prompt with another first word: no server has any of its prefix cached."""
    return f"Unit{n}" + SYSTEM[len("You") :]


def chat(user: str, system: str = SYSTEM) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


# --- one streamed request ---------------------------------------------------------------------


@dataclass
class Stream:
    sent: float  # perf_counter when the request went out
    first: float  # the first chunk with content
    last: float  # the last chunk with content
    tokens: int  # completion tokens: the server's usage, else its content chunks
    prompt_tokens: int  # -1 where the stream has no usage
    from_usage: bool

    @property
    def ttft(self) -> float:
        return self.first - self.sent


def stream_chat(client: httpx.Client, messages: list[dict[str, str]], max_tokens: int) -> Stream:
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    first = last = 0.0
    chunks = 0
    usage: dict[str, Any] | None = None
    # A connection per request: llama-server (cpp-httplib) now and then closes a kept-alive
    # connection just as the next request goes out on it ("Server disconnected without sending a
    # response"), and a connect is well under a millisecond next to any TTFT here.
    headers = {"connection": "close"}
    with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            doc = json.loads(line[6:])
            if "error" in doc:
                raise RuntimeError(f"error event: {doc['error']}")
            if doc.get("usage"):
                usage = doc["usage"]
            for choice in doc.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    chunks += 1
    if not first:
        raise RuntimeError(f"a stream ended without content (usage {usage})")
    if usage is not None:
        return Stream(sent, first, last, int(usage["completion_tokens"]), int(usage["prompt_tokens"]), True)
    return Stream(sent, first, last, chunks, -1, False)


def concurrent(
    client_of: Callable[[], httpx.Client], n: int, work: Callable[[httpx.Client, int], list[Stream]]
) -> list[Stream]:
    """``work(client, k)`` on ``n`` threads at once, each with its own connection."""

    def run(k: int) -> list[Stream]:
        with client_of() as c:
            return work(c, k)

    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(run, k) for k in range(n)]
    failed = [e for e in (f.exception() for f in futures) if e is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} of {n} concurrent clients failed: {failed[0]!r}")
    return [s for f in futures for s in f.result()]


def aggregate_tps(streams: list[Stream]) -> float:
    """Tokens decoded after each stream's first, over the span from the first first token to
    the last token: the prompt's prefill and the first token are TTFT, not decode."""
    span = max(s.last for s in streams) - min(s.first for s in streams)
    decoded = sum(s.tokens - 1 for s in streams)
    return decoded / span if span > 0 else 0.0


# --- the servers ------------------------------------------------------------------------------


class LlmServer(Server):
    """A server of ``/v1/chat/completions`` over HTTP; the subclass says how to start it."""

    ready_path = "/health"

    def __init__(self, work: Path, model: Path) -> None:
        super().__init__(work, {})
        self.model = model
        self.port = free_port()

    @property
    def addr(self) -> str | tuple[str, int]:
        return ("127.0.0.1", self.port)

    def is_ready(self) -> bool:
        return http_status(self.addr, self.ready_path) == 200

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=300)


class LlamaServer(LlmServer):
    """llama.cpp's ``llama-server``: continuous batching over ``-np`` slots of one context."""

    name = "llama-server"

    def __init__(self, work: Path, model: Path, binary: Path) -> None:
        super().__init__(work, model)
        self.binary = binary

    def command(self) -> list[str]:
        return [
            str(self.binary),
            *("-m", str(self.model), "-np", str(SLOTS), "-c", str(SLOTS * CONTEXT)),
            *("-t", str(CORES), "-tb", str(CORES), "--host", "127.0.0.1", "--port", str(self.port)),
        ]


class LlamaCppPythonServer(LlmServer):
    """llama-cpp-python's OpenAI server: one ``Llama``, one sequence; requests queue for it."""

    name = "llama_cpp.server"
    ready_path = "/v1/models"  # it has no health endpoint; this answers once the model is loaded

    def command(self) -> list[str]:
        cmd = [self.python, "-m", "llama_cpp.server", "--model", str(self.model), "--port", str(self.port)]
        cmd += ["--n_threads", str(CORES), "--n_threads_batch", str(CORES), "--n_ctx", str(CONTEXT)]
        # By default a new request cuts the stream in progress short; queueing them is what a
        # user serving several clients configures.
        return [*cmd, "--interrupt_requests", "False", "--verbose", "False"]


class LazyServer(LlmServer):
    """bench/llm_lazy.py: ready at once, loads the GGUF on the first request, as Ollama does."""

    name = "lazy wrapper"
    ready_path = "/"

    def command(self) -> list[str]:
        return [self.python, "-m", "bench.llm_lazy", str(self.model), str(self.port), str(CORES)]


class EdgedLlm(Server):
    """edged on its Unix socket; its engine cache lives in ``cache`` so that a second start with
    the same directory restores the saved system prompt."""

    name = "edged"

    def __init__(self, work: Path, model: Path, cache: Path, label: str = "edged") -> None:
        self.name = label
        super().__init__(work, {})
        self.model = model
        self.cache = cache

    @property
    def addr(self) -> str:
        return str(self.dir / "edged.sock")

    def config(self) -> Path:
        def q(v: str | Path) -> str:
            return json.dumps(str(v))  # a JSON string is a TOML basic string

        text = (
            f"[server]\nsocket = {q(self.addr)}\n"
            f"[cache]\ndir = {q(self.cache)}\n"
            "[lifecycle]\nwatch_files = false\n"
            f"[models.{MODEL}]\npath = {q(self.model)}\nthreads = {CORES}\n"
            f"queue_depth = {2 * SLOTS}\ntimeout_ms = 300000\n"
            f"[models.{MODEL}.llm]\nslots = {SLOTS}\ncontext = {CONTEXT}\nsystem_prompt = {q(SYSTEM)}\n"
        )
        path = self.dir / "edged.toml"
        path.write_text(text)
        return path

    def command(self) -> list[str]:
        return [self.python, "-m", "edged", "serve", "--config", str(self.config())]

    def is_ready(self) -> bool:
        return http_status(self.addr, "/v2/health/ready") == 200

    def client(self) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=self.addr), base_url="http://edged", timeout=300)


def http_status(addr: Address, path: str) -> int:
    """The status of a GET, 0 while the server accepts but does not answer yet."""
    with connect(addr, timeout=2) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n".encode())
        head = s.recv(4096).split(b" ", 2)
    return int(head[1]) if len(head) > 1 and head[1].isdigit() else 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- measuring one server ---------------------------------------------------------------------


class Counter:
    """Distinct request numbers across a run: no two requests share a user turn."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> int:
        self.n += 1
        return self.n


LlmTarget = EdgedLlm | LlmServer


class Floor:
    """llama.cpp through llama-cpp-python in this process: one sequence, the same rendered chat
    prompt, greedy decoding of the same number of new tokens; no server, no HTTP."""

    name = "in process (floor)"

    def __init__(self, model: Path) -> None:
        import llama_cpp
        from llama_cpp import Llama
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        t0 = time.perf_counter()
        self.llm = Llama(str(model), n_ctx=CONTEXT, n_threads=CORES, n_threads_batch=CORES, verbose=False)
        self.load_s = time.perf_counter() - t0
        mdl = self.llm._model
        self.vocab = mdl.vocab
        self.is_eog = llama_cpp.llama_vocab_is_eog
        self.fmt = Jinja2ChatFormatter(
            template=self.llm.metadata["tokenizer.chat_template"],
            eos_token=mdl.token_get_text(self.llm.token_eos()),
            bos_token=mdl.token_get_text(self.llm.token_bos()),
        )

    def decode(self, turn: int) -> tuple[float, int]:
        """Tokens/s after the first token, and the tokens made."""
        prompt = self.fmt(messages=cast(Any, chat(decode_turn(turn)))).prompt
        ids = self.llm.tokenize(prompt.encode(), add_bos=False, special=True)
        self.llm.reset()  # a whole prefill each time, as for a new request to a server
        first = last = 0.0
        count = 0
        for tok in self.llm.generate(ids, temp=0.0, top_k=1):
            if self.is_eog(self.vocab, tok):
                break
            last = time.perf_counter()
            first = first or last
            count += 1
            if count >= DECODE_TOKENS:
                break
        return (count - 1) / (last - first), count

    def close(self) -> None:
        self.llm.close()


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


# --- summary ----------------------------------------------------------------------------------


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


def main(argv: list[str] | None = None) -> None:
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
        work = Path(tempfile.mkdtemp(prefix="edged-llm-bench-"))
        cache = work / "cache"  # empty: edged's first start prefills the system prompt and saves it
        servers: list[LlmTarget] = []
        if "edged" in args.servers:
            servers.append(EdgedLlm(work, model, cache))
        if binary is not None:
            servers.append(LlamaServer(work, model, binary))
        if "llama_cpp.server" in args.servers and "llama_cpp.server" not in skipped:
            servers.append(LlamaCppPythonServer(work, model))
        if "lazy" in args.servers:
            servers.append(LazyServer(work, model))
        servers = servers[r % len(servers) :] + servers[: r % len(servers)] if servers else []
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
        "setup": {
            "model": str(model),
            "cores": CORES,
            "slots": SLOTS,
            "context_per_sequence": CONTEXT,
            "decode_tokens": DECODE_TOKENS,
            "llama_server": str(binary) if binary else None,
            "llama_cpp_python": llama_server.version(),
            "load_average_start": load_start,
            "load_average_end": os.getloadavg(),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
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
    print(f"results: {args.out} (servers' logs in {logs})")


if __name__ == "__main__":
    main()
