"""A language model served warm by edged, against llama-cpp-python's own
OpenAI-compatible server (``llama_cpp.server``, which loads at start) and a lazy-loading wrapper
(bench/llm_lazy.py: loads on the first request, as Ollama does), with the engine in process as
the floor. Same GGUF (SmolLM2-135M-Instruct Q4_1), same prompts (``/v1/completions``, so every
server tokenises the same text), same threads per sequence; interleaved: each round starts,
measures and stops every server in turn, the order rotating between rounds.

Measured per server: start → ready; time to first token (TTFT) of the first request after ready;
steady TTFT p50/p99; decode tokens/s of one stream and, concurrently, of four; RSS and PSS of the
process tree at the end.

    .venv/bin/pip install 'llama-cpp-python[server]'      # the peer's server extra
    .venv/bin/python -m bench.llm data/models/smollm2.gguf [--rounds 2] [--out bench-results/llm.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:  # the HTTP client that the openai package itself uses (httpx2 from openai 3 on)
    import httpx2 as httpx
except ImportError:  # pragma: no cover - older openai releases
    import httpx  # type: ignore[no-redef]

from bench.servers import tree_memory

REPO = Path(__file__).resolve().parent.parent
THREADS = 1  # per sequence: with 2 cores, four streams at 1 thread each use the machine
CONTEXT = 2048
SLOTS = 4
STEADY = 12
DECODE_TOKENS = 64
TEXT = (
    "The maintenance log of the packaging line records temperature, vibration and motor current for "
    "every station once a second. Yesterday station {i} showed a slow rise in vibration from noon, "
    "a short current spike at {h}:40 and a temperature {t} degrees above its weekly mean by evening. "
    "The operator replaced a belt at station {j} in the morning and restarted the line twice. "
)


def prompt(i: int) -> str:
    """About 200 tokens, different from the first word on so no server reuses a cached prefix."""
    body = "".join(
        TEXT.format(i=(i * 7 + k) % 97, h=(i + k) % 24, t=3 + (i + k) % 9, j=(i + 3 * k) % 31) for k in range(3)
    )
    return f"Report {i}. {body}\nQuestion: what should the technician check first, and why?\nAnswer:"


def decode_prompt(i: int) -> str:
    """A continuation a small model keeps going without an end-of-sequence: decode speed."""
    start = 100 + 37 * i
    return f"Counting from {start}: " + ", ".join(str(start + k) for k in range(12)) + ","


@dataclass
class Stream:
    ttft: float
    tokens: int
    decode_s: float  # first token to last token
    started: float = 0.0
    ended: float = 0.0


def sse_stream(client: httpx.Client, path: str, body: dict[str, Any]) -> Stream:
    t0 = time.perf_counter()
    first = last = 0.0
    n = 0
    with client.stream("POST", path, json=dict(body, stream=True)) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{path}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            doc = json.loads(line[6:])
            choice = doc["choices"][0] if doc.get("choices") else {}
            now = time.perf_counter()
            if choice.get("text"):
                first = first or now
                last, n = now, n + 1
            elif choice.get("finish_reason"):  # ended at once (end of sequence): its first token came now
                first = first or now
    return Stream(first - t0, n, last - first, t0, last)


@dataclass
class Peer:
    name: str
    command: list[str] = field(default_factory=list)
    ready_path: str = "/v1/models"
    uds: str = ""
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    def client(self) -> httpx.Client:
        if self.uds:
            return httpx.Client(transport=httpx.HTTPTransport(uds=self.uds), base_url="http://edged", timeout=300)
        return httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=300)

    def start(self, work: Path) -> float:
        t0 = time.perf_counter()
        env = dict(os.environ, HOME=str(work), TMPDIR=str(work))
        log = open(work / f"{self.name}.log", "ab")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(self.command, stdout=log, stderr=log, env=env, cwd=REPO, start_new_session=True)
        with self.client() as c:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited: {(work / f'{self.name}.log').read_text()[-2000:]}")
                try:
                    if c.get(self.ready_path, timeout=2).status_code == 200:
                        return time.perf_counter() - t0
                except httpx.TransportError:
                    pass
                time.sleep(0.01)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def edged_peer(model: Path, work: Path) -> Peer:
    sock = work / "edged.sock"
    cfg = work / "edged.toml"
    cfg.write_text(
        f'[server]\nsocket = "{sock}"\n[cache]\ndir = "{work / "cache"}"\n'
        f'[models.llm]\npath = "{model}"\nthreads = {THREADS}\nqueue_depth = 8\ntimeout_ms = 120000\n'
        f"[models.llm.llm]\ncontext = {CONTEXT}\nslots = {SLOTS}\n"
    )
    cmd = [sys.executable, "-m", "edged", "serve", "--config", str(cfg)]
    return Peer("edged", cmd, "/v2/health/ready", uds=str(sock))


def llama_server_peer(model: Path) -> Peer:
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--port", str(port)]
    cmd += ["--n_threads", str(THREADS), "--n_threads_batch", str(THREADS), "--n_ctx", str(CONTEXT), "--verbose", "0"]
    # By default a new request interrupts the stream in progress (3 of 4 concurrent streams cut in
    # one run); queueing them is what a user serving several clients would configure.
    cmd += ["--interrupt_requests", "False"]
    return Peer("llama_cpp.server", cmd, "/v1/models", port=port)


def lazy_peer(model: Path) -> Peer:
    port = free_port()
    return Peer(
        "lazy wrapper", [sys.executable, "-m", "bench.llm_lazy", str(model), str(port), str(THREADS)], "/", port=port
    )


def measure_server(peer: Peer, work: Path, round_no: int) -> dict[str, Any]:
    out: dict[str, Any] = {"start_to_ready_s": peer.start(work)}
    try:
        body = {"model": "llm", "max_tokens": 8, "temperature": 0.0}
        with peer.client() as c:
            out["first_ttft_s"] = sse_stream(c, "/v1/completions", dict(body, prompt=prompt(1000 + round_no))).ttft
            steady = [sse_stream(c, "/v1/completions", dict(body, prompt=prompt(i))).ttft for i in range(STEADY)]
            one = [
                sse_stream(c, "/v1/completions", dict(body, prompt=decode_prompt(i), max_tokens=DECODE_TOKENS))
                for i in range(2)
            ]
        out["steady_ttft_s"] = steady
        out["tps_1"] = decode_rate(one)
        out["tps_4"] = concurrent(peer, 4)
        assert peer.proc is not None
        out["memory"] = tree_memory(peer.proc.pid)
    finally:
        peer.stop()
    return out


def decode_rate(streams: list[Stream]) -> float:
    if any(s.tokens < DECODE_TOKENS // 2 for s in streams):
        raise RuntimeError(f"a decode run ended early: {[s.tokens for s in streams]} tokens")
    return statistics.median((s.tokens - 1) / s.decode_s for s in streams)


def concurrent(peer: Peer, n: int) -> float:
    results: list[Stream] = []
    failed: list[str] = []

    def run(i: int) -> None:
        with peer.client() as c:
            body = {"model": "llm", "prompt": decode_prompt(10 + i), "max_tokens": DECODE_TOKENS, "temperature": 0.0}
            try:
                results.append(sse_stream(c, "/v1/completions", body))
            except (httpx.HTTPError, RuntimeError) as e:
                failed.append(f"{e.__class__.__name__}: {e}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        raise RuntimeError(f"{peer.name}: {len(failed)} of {n} concurrent streams failed: {failed[0]}")
    first = min(s.started + s.ttft for s in results)
    last = max(s.ended for s in results)
    return sum(s.tokens - 1 for s in results) / (last - first)


def measure_in_process(model: Path, round_no: int) -> dict[str, Any]:
    """The floor: the engine itself, no server, same prompts and threads."""
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(str(model), n_ctx=CONTEXT, n_threads=THREADS, n_threads_batch=THREADS, verbose=False)
    load = time.perf_counter() - t0

    def run(p: str, max_tokens: int) -> Stream:
        t = time.perf_counter()
        first = last = 0.0
        n = 0
        for chunk in llm.create_completion(p, max_tokens=max_tokens, temperature=0.0, stream=True):
            now = time.perf_counter()
            if chunk["choices"][0]["text"]:
                first = first or now
                last, n = now, n + 1
            elif chunk["choices"][0]["finish_reason"]:
                first = first or now
        return Stream(first - t, n, last - first)

    first = run(prompt(1000 + round_no), 8).ttft
    steady = [run(prompt(i), 8).ttft for i in range(STEADY)]
    one = [run(decode_prompt(i), DECODE_TOKENS) for i in range(2)]
    llm.close()
    return {
        "start_to_ready_s": load,
        "first_ttft_s": first,
        "steady_ttft_s": steady,
        "tps_1": decode_rate(one),
    }


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    table = {}
    for name, rs in runs.items():
        steady = sorted(t for r in rs for t in r["steady_ttft_s"])
        p50 = statistics.median(steady)
        p99 = steady[min(len(steady) - 1, int(0.99 * len(steady)))]
        first = statistics.median(r["first_ttft_s"] for r in rs)
        row = {
            "start_to_ready_s": statistics.median(r["start_to_ready_s"] for r in rs),
            "first_ttft_ms": first * 1e3,
            "steady_ttft_p50_ms": p50 * 1e3,
            "steady_ttft_p99_ms": p99 * 1e3,
            "first_over_steady": first / p50,
            "tps_1": statistics.median(r["tps_1"] for r in rs),
        }
        if "tps_4" in rs[0]:
            row["tps_4"] = statistics.median(r["tps_4"] for r in rs)
            row["tps_4_over_1"] = row["tps_4"] / row["tps_1"]
            row["rss_mib"] = max(r["memory"]["rss_mib"] for r in rs)
            row["pss_mib"] = max(r["memory"]["pss_mib"] for r in rs)
        table[name] = row
    return table


def markdown(table: dict[str, dict[str, Any]]) -> str:
    cols = [
        ("start_to_ready_s", "start→ready s", "{:.2f}"),
        ("first_ttft_ms", "first TTFT ms", "{:.0f}"),
        ("steady_ttft_p50_ms", "steady TTFT p50 ms", "{:.0f}"),
        ("steady_ttft_p99_ms", "p99 ms", "{:.0f}"),
        ("first_over_steady", "first/steady", "{:.2f}"),
        ("tps_1", "tok/s 1 stream", "{:.1f}"),
        ("tps_4", "tok/s 4 streams", "{:.1f}"),
        ("rss_mib", "RSS MiB", "{:.0f}"),
        ("pss_mib", "PSS MiB", "{:.0f}"),
    ]
    lines = ["| server | " + " | ".join(c[1] for c in cols) + " |", "|" + " --- |" * (len(cols) + 1)]
    for name, row in table.items():
        cells = [c[2].format(row[c[0]]) if c[0] in row else "-" for c in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    global STEADY
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("model", type=Path)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steady", type=int, default=STEADY, help="steady requests per server and round")
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "llm.json")
    args = ap.parse_args(argv)
    model = args.model.resolve()
    STEADY = args.steady
    makers: list[tuple[str, Callable[[Path], Peer] | None]] = [
        ("edged", lambda w: edged_peer(model, w)),
        ("llama_cpp.server", lambda w: llama_server_peer(model)),
        ("lazy wrapper", lambda w: lazy_peer(model)),
        ("in process (floor)", None),
    ]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in makers}
    for r in range(args.rounds):
        order = makers[r % len(makers) :] + makers[: r % len(makers)]
        for name, make in order:
            with tempfile.TemporaryDirectory(prefix="edged-llm-bench-") as tmp:
                work = Path(tmp)
                res = measure_in_process(model, r) if make is None else measure_server(make(work), work, r)
            runs[name].append(res)
            sys.stderr.write(
                f"round {r + 1}: {name}: {json.dumps({k: v for k, v in res.items() if k != 'steady_ttft_s'})}\n"
            )
            time.sleep(2)  # let the previous server's threads go quiet
    table = summarise(runs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"table": table, "runs": runs, "threads": THREADS, "slots": SLOTS}, indent=1))
    print(markdown(table))


if __name__ == "__main__":
    main()
