"""The servers that the language-model benchmark (bench/llm.py) starts and measures, each a
process serving ``/v1/chat/completions``: edged on its Unix socket, llama.cpp's ``llama-server``,
llama-cpp-python's OpenAI server and the lazy-loading wrapper (bench/llm_lazy.py) over HTTP; and
how to tell that one is ready.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

from bench.llm_stream import httpx  # the one HTTP client the benchmark uses (see there)
from bench.llm_workload import CONTEXT, CORES, MODEL, SLOTS, SYSTEM
from bench.servers import Server
from bench.wire import Address, connect


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


LlmTarget = EdgedLlm | LlmServer
