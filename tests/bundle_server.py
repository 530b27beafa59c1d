"""A real HTTP server for bundle archives: ThreadingHTTPServer on a free loopback port, serving
the files of one folder with Range requests (``Range: bytes=N-``, answered 206), an optional
pace in bytes a second (so that a test can stop a device mid-download), and a record of every
request's path and Range header (what a test asserts a resumed download sent)."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Served:
    path: str
    range: str
    sent: int = 0


@dataclass
class BundleServer:
    root: Path
    port: int = 0
    pace: dict[str, int] = field(default_factory=dict)  # file name -> bytes a second
    requests: list[Served] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    def sent(self, name: str) -> int:
        with self.lock:
            return sum(r.sent for r in self.requests if r.path == f"/{name}")

    def ranges(self, name: str) -> list[str]:
        with self.lock:
            return [r.range for r in self.requests if r.path == f"/{name}"]


def _handler(server: BundleServer) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            name = self.path.lstrip("/")
            path = server.root / name
            record = Served(self.path, self.headers.get("Range", ""))
            with server.lock:
                server.requests.append(record)
            if "/" in name or not path.is_file():
                self.send_error(404)
                return
            data = path.read_bytes()
            start = 0
            if record.range.startswith("bytes="):
                start = int(record.range[6:].split("-")[0])
                if start >= len(data):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            else:
                self.send_response(200)
            self.send_header("Content-Length", str(len(data) - start))
            self.end_headers()
            self._send(data[start:], server.pace.get(name, 0), record)

        def _send(self, body: bytes, pace: int, record: Served) -> None:
            step = max(1024, pace // 20) if pace else len(body)
            for i in range(0, len(body), step):
                try:
                    self.wfile.write(body[i : i + step])
                    self.wfile.flush()
                except OSError:
                    return  # the device went away mid-transfer
                with server.lock:
                    record.sent += len(body[i : i + step])
                if pace:
                    time.sleep(step / pace)  # the pace of a slow link, not a synchronisation

    return Handler


@contextmanager
def bundle_server(root: Path) -> Iterator[BundleServer]:
    state = BundleServer(root)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    httpd.daemon_threads = True
    state.port = int(httpd.server_address[1])
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)
