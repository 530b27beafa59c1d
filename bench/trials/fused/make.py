"""A trial, not product code: a copy of this tree's edged whose app answers an inline model's infer
request with only what any V2 server must do: the body read, the decode (with the plan cache),
the run and the encode. No checks of the tensors, no statistics, metrics, readiness or shared
memory: what edged's app structure costs on the request path, measured beside edged itself.

    python bench/trials/fused/make.py data/base-fused
    scripts/bench.sh overhead --model tiny --lanes edged,limitv2,fastapi --base data/base-fused --restarts 4
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
ANCHOR = """    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:"""
FUSED = """    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]  # the trial's path (bench/trials/fused): nothing but decode, run, encode
        if scope["method"] == "POST" and path.endswith("/infer") and self.service.ready.is_set():
            parts = path.strip("/").split("/")
            rt = self.service.registry.models.get(parts[2]) if len(parts) == 4 else None
            q = rt.queue if rt is not None else None
            inst = q._inline_instance if q is not None else None
            if rt is not None and inst is not None:
                from edged.wire.encode import _encode_small
                from edged.wire.decode import decode_infer, parse_header_length
                from edged.transports.http.body import body_headers, read_body

                headers = body_headers(scope)
                body = await read_body(scope, receive, self.max_body, headers)
                hl = None
                for value in headers.header_lengths:
                    hl = parse_header_length(value, "Inference-Header-Content-Length")
                req = decode_infer(body, hl, None, self.service.plan_for(rt).limits)
                out = inst._infer_impl(req.inputs)
                b, n = _encode_small(parts[2], req, out, None)
                hdrs = [(b"content-type", b"application/octet-stream"), (b"content-length", str(len(b)).encode())]
                if n is not None:
                    hdrs.append((b"inference-header-content-length", str(n).encode()))
                await send({"type": "http.response.start", "status": 200, "headers": hdrs})
                await send({"type": "http.response.body", "body": b})
                return
        try:"""


def main() -> None:
    dest = Path(sys.argv[1])
    shutil.rmtree(dest / "edged", ignore_errors=True)
    shutil.copytree(REPO / "edged", dest / "edged", ignore=shutil.ignore_patterns("__pycache__"))
    http = dest / "edged" / "transports" / "http.py"
    text = http.read_text()
    if ANCHOR not in text:
        raise SystemExit("edged/transports/http/app.py: App._serve changed; update the trial")
    http.write_text(text.replace(ANCHOR, FUSED, 1))
    print(f"the fused trial of edged in {dest / 'edged'}")


if __name__ == "__main__":
    main()
