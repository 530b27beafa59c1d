"""The lazy-loading peer of bench/llm.py: how Ollama and most local wrappers serve a model. It
answers at once after start, loads the GGUF on the first request (llama-cpp-python, the same
engine and threads as edged), and unloads it after an idle timeout. OpenAI's streaming
``/v1/chat/completions`` (the GGUF's chat template, as llama-cpp-python applies it) and
``/v1/completions`` only, one generation at a time, with the standard library's threading HTTP
server; any GET answers 200 (it is ready at once: that is the point).

    python -m bench.llm_lazy MODEL.gguf PORT [THREADS] [IDLE_S]
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast

from llama_cpp import Llama


class Lazy:
    def __init__(self, path: str, threads: int, idle_s: float) -> None:
        self.path, self.threads, self.idle_s = path, threads, idle_s
        self.lock = threading.Lock()
        self.llm: Llama | None = None
        self.last = time.monotonic()
        threading.Thread(target=self._reaper, daemon=True).start()

    def _reaper(self) -> None:
        while True:
            time.sleep(1)
            with self.lock:
                if self.llm is not None and time.monotonic() - self.last > self.idle_s:
                    self.llm.close()
                    self.llm = None

    def model(self) -> Llama:
        if self.llm is None:
            self.llm = Llama(self.path, n_ctx=2048, n_threads=self.threads, n_threads_batch=self.threads, verbose=False)
        return self.llm


def handler(lazy: Lazy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            return

        def do_GET(self) -> None:
            body = b'{"status": "ok"}'
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            req = json.loads(self.rfile.read(int(self.headers["content-length"])))
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("connection", "close")
            self.end_headers()
            sampling: dict[str, Any] = {
                "max_tokens": req.get("max_tokens", 16),
                "temperature": req.get("temperature", 0.0),
                "seed": req.get("seed"),
                "stream": True,
            }
            with lazy.lock:  # one generation at a time, as one llama.cpp context allows
                llm = lazy.model()
                chunks: Iterator[Any]
                if self.path == "/v1/chat/completions":
                    chunks = cast(Iterator[Any], llm.create_chat_completion(req["messages"], **sampling))
                else:
                    chunks = cast(Iterator[Any], llm.create_completion(req["prompt"], **sampling))
                for chunk in chunks:
                    self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                    self.wfile.flush()
                lazy.last = time.monotonic()
            self.wfile.write(b"data: [DONE]\n\n")
            self.close_connection = True

    return Handler


def main() -> None:
    path, port = sys.argv[1], int(sys.argv[2])
    threads = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    idle = float(sys.argv[4]) if len(sys.argv) > 4 else 300.0
    ThreadingHTTPServer(("127.0.0.1", port), handler(Lazy(path, threads, idle))).serve_forever()


if __name__ == "__main__":
    main()
