"""One streamed ``/v1/chat/completions`` request, timed chunk by chunk (sent, first content,
last content, tokens), and many of them at once on threads: what every TTFT and tokens/s figure
of the language-model benchmark (bench/llm.py) is made of.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

try:  # the HTTP client that the openai package itself uses (httpx2 from openai 3 on)
    import httpx2 as httpx
except ImportError:  # pragma: no cover - older openai releases
    import httpx  # type: ignore[no-redef]

from bench.llm_workload import MODEL


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
