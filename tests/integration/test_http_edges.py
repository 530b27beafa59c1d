"""The edges of the HTTP protocol, with raw HTTP on the Unix socket against a real daemon:
versions, unloaded models (also over MQTT), 405 with Allow, HEAD, compressed bodies in both
directions (a zip bomb is a 413), and the shared memory extension's parameter rules."""

from __future__ import annotations

import gzip
import json
import socket
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from tests.helpers import DaemonProcess, raw_http, write_config
from tests.integration.mosquitto import Broker, Peer, broker
from tests.integration.mqtt_daemon import Edged, code_of, json_request

pytestmark = pytest.mark.integration

__all__ = ["broker"]  # a fixture: imported so that pytest finds it

MAX_BODY = 2 << 20


request = raw_http


def code(data: bytes) -> str:
    doc = orjson.loads(data)
    if isinstance(doc.get("error"), dict):  # the OpenAI routes' shape
        doc = doc["error"]
    return str(doc.get("code"))


def infer_body(x: np.ndarray) -> bytes:
    return orjson.dumps(
        {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel()}]},
        option=orjson.OPT_SERIALIZE_NUMPY,
    )


def gzip_zeros(mib: int) -> bytes:
    """``mib`` MiB of zeros as one valid gzip member, built in milliseconds: each MiB is deflated
    after a full flush (so every block compresses to the same bytes) and the trailer is computed."""
    z = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    block = bytes(1 << 20)
    unit = z.compress(block) + z.flush(zlib.Z_FULL_FLUSH)
    crc = 0
    for _ in range(mib):
        crc = zlib.crc32(block, crc)
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
    end = z.flush()  # an empty final block
    return header + unit * mib + end + struct.pack("<II", crc, (mib << 20) & 0xFFFFFFFF)


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[DaemonProcess]:
    tmp = tmp_path_factory.mktemp("edges")
    cfg = write_config(
        tmp / "edged.toml",
        {
            "server": {"socket": str(tmp / "edged.sock"), "max_body": str(MAX_BODY)},
            "cache": {"dir": str(tmp / "cache")},
            "build": {"block_ready": True},
            "models.tiny": {"path": str(model_dir / "tiny.onnx")},
            "models.spare": {"path": str(model_dir / "tiny_b.onnx")},
            "models.lazy": {"path": str(model_dir / "tiny_b.onnx"), "preload": "lazy"},
        },
    )
    d = DaemonProcess(cfg, tmp / "edged.sock", tmp / "edged.log").start()
    yield d
    assert d.stop() == 0, d.log()


# --- versions and model state ------------------------------------------------------------------


def test_only_version_1_exists(served: DaemonProcess) -> None:
    s = served.socket
    assert request(s, "GET", "/v2/models/tiny/versions/1/ready")[0] == 200
    assert request(s, "GET", "/v2/models/tiny/versions/1")[0] == 200
    for path in ("/v2/models/tiny/versions/2/ready", "/v2/models/tiny/versions/7", "/v2/models/tiny/versions/0/infer"):
        method = "POST" if path.endswith("infer") else "GET"
        status, data, _ = request(s, method, path, infer_body(np.zeros((1, 16), np.float32)))
        assert (status, code(data)) == (404, "model_version_not_found"), path
        assert "no version" in orjson.loads(data)["error"]
    status, data, _ = request(s, "GET", "/v2/models/nope/versions/2/ready")
    assert (status, code(data)) == (404, "model_not_found")
    x = np.ones((1, 16), np.float32)
    status, data, _ = request(s, "POST", "/v2/models/tiny/versions/1/infer", infer_body(x))
    assert status == 200 and orjson.loads(data)["model_version"] == "1"


def test_an_unloaded_model_is_not_ready_until_loaded(served: DaemonProcess) -> None:
    s, x = served.socket, np.ones((1, 16), np.float32)
    assert request(s, "POST", "/v2/repository/models/spare/unload")[0] == 200
    for _ in range(2):  # the first refusal does not load it behind the operator's back either
        status, data, _ = request(s, "POST", "/v2/models/spare/infer", infer_body(x))
        assert (status, code(data)) == (503, "model_not_ready")
        assert "unloaded" in orjson.loads(data)["error"] and "/load" in orjson.loads(data)["error"]
    assert request(s, "GET", "/v2/models/spare/ready")[0] == 503
    assert request(s, "POST", "/v2/repository/models/spare/load")[0] == 200
    status, data, _ = request(s, "POST", "/v2/models/spare/infer", infer_body(x))
    assert status == 200 and orjson.loads(data)["outputs"][0]["shape"] == [1, 4]


def test_a_lazy_model_still_loads_on_its_first_request(served: DaemonProcess) -> None:
    s = served.socket
    assert request(s, "GET", "/v2/models/lazy/ready")[0] == 503
    status, _, _ = request(s, "POST", "/v2/models/lazy/infer", infer_body(np.ones((1, 16), np.float32)))
    assert status == 200
    assert request(s, "GET", "/v2/models/lazy/ready")[0] == 200


def test_mqtt_sees_an_unloaded_model_as_not_ready(broker: Broker, model_dir: Path, tmp_path: Path) -> None:
    edge = Edged(
        tmp_path / "edge", broker.port, "dev-e", {"tiny": {"path": str(model_dir / "tiny.onnx")}}, tmp_path / "cache"
    )
    edge.start()
    try:
        topic, reply = "edged/dev-e/models/tiny/infer", "test/replies"
        with Peer(broker.port) as p:
            p.subscribe(reply)
            with edge.client() as c:
                c.unload("tiny")
            x = np.ones((1, 16), np.float32)
            p.request(topic, json_request(x), response_topic=reply, correlation=b"1")
            assert code_of(p.first(reply, lambda r: r.correlation == b"1")) == "model_not_ready"
            with edge.client() as c:
                c.load("tiny")
            p.request(topic, json_request(x), response_topic=reply, correlation=b"2")
            assert code_of(p.first(reply, lambda r: r.correlation == b"2")) == "ok"
    finally:
        assert edge.stop() == 0, edge.log()


# --- methods -----------------------------------------------------------------------------------


def test_405_names_the_allowed_methods(served: DaemonProcess) -> None:
    cases = {
        ("GET", "/v2/models/tiny/infer"): "POST",
        ("POST", "/v2/health/live"): "GET, HEAD",
        ("DELETE", "/metrics"): "GET, HEAD",
        ("PUT", "/v2/models/tiny"): "GET, HEAD",
        ("GET", "/v2/repository/index"): "POST",
        ("POST", "/v2/systemsharedmemory/status"): "GET, HEAD",
        ("POST", "/v1/models"): "GET, HEAD",  # the generation routes answer the same way
        ("PUT", "/v2/logging"): "GET, POST, HEAD",  # Triton's extensions too
        ("GET", "/v2/cudasharedmemory/unregister"): "POST",
        ("POST", "/v2/models/stats"): "GET, HEAD",
        ("POST", "/v2/models/tiny/versions/1/config"): "GET, HEAD",
    }
    for (method, path), allow in cases.items():
        status, data, resp = request(served.socket, method, path)
        assert (status, code(data)) == (405, "method_not_allowed"), (method, path)
        assert resp.getheader("allow") == allow, (method, path)


def _read_response(s: socket.socket, buf: bytearray, head_only: bool) -> tuple[bytes, dict[str, str], bytes]:
    deadline = time.monotonic() + 30
    while b"\r\n\r\n" not in buf:
        assert time.monotonic() < deadline, "no response"
        chunk = s.recv(65536)
        assert chunk, "connection closed"
        buf += chunk
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = 0 if head_only else int(headers["content-length"])
    while len(rest) < length:
        chunk = s.recv(65536)
        assert chunk, "connection closed"
        rest += chunk
    buf[:] = rest[length:]
    return lines[0].encode(), headers, rest[:length]


def test_head_answers_as_get_without_a_body(served: DaemonProcess) -> None:
    """On one connection, HEAD then GET: the HEAD answer has GET's status and content-length,
    and the next bytes on the wire are the GET's status line (no body was sent)."""
    paths = ("/v2/health/live", "/v2/models/tiny", "/v2/models/lazy/ready", "/v2", "/v2/models/nope")
    triton = ("/v2/models/stats", "/v2/models/tiny/stats", "/v2/models/tiny/config", "/v2/logging")
    for path in (*paths, *triton, "/v2/cudasharedmemory/status"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(30)
            s.connect(str(served.socket))
            s.sendall(f"HEAD {path} HTTP/1.1\r\nHost: x\r\n\r\nGET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            buf = bytearray()
            head_status, head_headers, head_body = _read_response(s, buf, head_only=True)
            assert buf.startswith(b"HTTP/1.1 ") or not buf, bytes(buf[:40])
            get_status, get_headers, get_body = _read_response(s, buf, head_only=False)
        assert head_status == get_status, path
        assert head_body == b"" and len(get_body) == int(get_headers["content-length"]) > 0
        assert head_headers["content-length"] == get_headers["content-length"], path
        assert head_headers["content-type"] == get_headers["content-type"]
    status, data, resp = request(served.socket, "HEAD", "/metrics")
    assert status == 200 and data == b"" and int(resp.getheader("content-length", "0")) > 0
    status, data, resp = request(served.socket, "HEAD", "/v1/models")
    assert status == 200 and data == b"" and int(resp.getheader("content-length", "0")) > 0


# --- compressed bodies -------------------------------------------------------------------------


def test_gzip_and_deflate_request_bodies(served: DaemonProcess) -> None:
    x = np.random.default_rng(1).standard_normal((2, 16)).astype(np.float32)
    plain = request(served.socket, "POST", "/v2/models/tiny/infer", infer_body(x))
    assert plain[0] == 200
    for name, packed in (("gzip", gzip.compress(infer_body(x))), ("deflate", zlib.compress(infer_body(x)))):
        status, data, _ = request(served.socket, "POST", "/v2/models/tiny/infer", packed, {"Content-Encoding": name})
        assert status == 200 and data == plain[1], name
    # Binary extension: Inference-Header-Content-Length counts the uncompressed JSON (Triton's rule).
    header = orjson.dumps(
        {"inputs": [{"name": "x", "shape": [2, 16], "datatype": "FP32", "parameters": {"binary_data_size": 128}}]}
    )
    headers = {"Content-Encoding": "gzip", "Inference-Header-Content-Length": str(len(header))}
    status, data, _ = request(
        served.socket, "POST", "/v2/models/tiny/infer", gzip.compress(header + x.tobytes()), headers
    )
    assert status == 200 and data == plain[1]


def test_bad_compressed_bodies_are_precise_errors(served: DaemonProcess) -> None:
    body = infer_body(np.ones((1, 16), np.float32))
    packed = gzip.compress(body)
    cases = [
        ({"Content-Encoding": "br"}, body, 415, "unsupported_encoding", "'br' is not supported"),
        ({"Content-Encoding": "gzip, gzip"}, packed, 415, "unsupported_encoding", "one encoding"),
        ({"Content-Encoding": "gzip"}, body, 400, "bad_request", "corrupt"),
        ({"Content-Encoding": "gzip"}, packed[:-12], 400, "bad_request", "truncated"),
        ({"Content-Encoding": "gzip"}, packed + packed, 400, "bad_request", "follow the end"),
        ({"Content-Encoding": "deflate"}, packed, 400, "bad_request", "corrupt"),
    ]
    for headers, data, want_status, want_code, words in cases:
        status, answer, resp = request(served.socket, "POST", "/v2/models/tiny/infer", data, headers)
        assert (status, code(answer)) == (want_status, want_code), headers
        assert words in orjson.loads(answer)["error"], (words, answer)
        if status == 415:
            assert resp.getheader("accept-encoding") == "gzip, deflate"
    status, _, _ = request(served.socket, "POST", "/v2/models/tiny/infer", body, {"Content-Encoding": "identity"})
    assert status == 200


def test_the_generation_routes_read_compressed_bodies_too(served: DaemonProcess) -> None:
    doc = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}]}
    packed = gzip.compress(orjson.dumps(doc))
    status, data, _ = request(served.socket, "POST", "/v1/chat/completions", packed, {"Content-Encoding": "gzip"})
    # Read and understood: the answer is about the model (not a language model), not the body.
    assert (status, code(data)) == (400, "bad_request") and "'tiny' is not a language model" in data.decode()
    status, data, resp = request(served.socket, "POST", "/v1/chat/completions", packed, {"Content-Encoding": "br"})
    assert (status, code(data)) == (415, "unsupported_encoding")
    assert resp.getheader("accept-encoding") == "gzip, deflate"


def test_a_zip_bomb_is_a_413_and_allocates_no_more_than_max_body(served: DaemonProcess) -> None:
    assert gzip.decompress(gzip_zeros(3)) == bytes(3 << 20)  # the bomb below is valid gzip
    bomb = gzip_zeros(1024)  # 1 GiB of zeros
    assert len(bomb) < MAX_BODY  # accepted as sent: only inflating it runs into the limit
    assert served.proc is not None
    before = peak_rss(served.proc.pid)
    for encoding in ("gzip", "x-gzip"):
        status, data, _ = request(served.socket, "POST", "/v2/models/tiny/infer", bomb, {"Content-Encoding": encoding})
        assert (status, code(data)) == (413, "payload_too_large")
        assert f"inflates to more than {MAX_BODY} bytes" in orjson.loads(data)["error"]
    grown = peak_rss(served.proc.pid) - before
    assert grown < 32 << 20, f"peak RSS grew by {grown >> 20} MiB"
    # Too large as sent: refused before it is read.
    status, data, _ = request(
        served.socket, "POST", "/v2/models/tiny/infer", bytes(MAX_BODY + 1), {"Content-Encoding": "gzip"}
    )
    assert (status, code(data)) == (413, "payload_too_large")
    status, _, _ = request(served.socket, "POST", "/v2/models/tiny/infer", infer_body(np.ones((1, 16), np.float32)))
    assert status == 200  # still serving


def test_control_routes_take_small_bodies_only(served: DaemonProcess) -> None:
    """Log settings, shared memory registration and unload are parsed on the loop: their bodies
    are bounded far below max_body, as sent and as inflated. A load may bring a model's files:
    its body may be as large as max_body, and a large one is parsed off the loop."""
    from edged.transports.http.control import CONTROL_BODY

    big = b"[" + b"0," * CONTROL_BODY + b"0]"
    routes = ["/v2/logging", "/v2/systemsharedmemory/region/r/register", "/v2/repository/models/tiny/unload"]
    for path in routes:
        status, data, _ = request(served.socket, "POST", path, big)
        assert (status, code(data)) == (413, "payload_too_large"), (path, data)
    status, data, _ = request(served.socket, "POST", "/v2/repository/models/tiny/load", big)
    assert (status, code(data)) == (400, "bad_request") and b"must be a JSON object" in data
    status, data, _ = request(served.socket, "POST", "/v2/logging", gzip.compress(big), {"Content-Encoding": "gzip"})
    assert (status, code(data)) == (413, "payload_too_large")
    status, data, _ = request(served.socket, "GET", "/v2/logging")
    assert status == 200 and "log_verbose_level" in orjson.loads(data)


def test_answers_are_compressed_when_accepted_and_large(served: DaemonProcess) -> None:
    x = np.random.default_rng(2).standard_normal((512, 16)).astype(np.float32)  # about 20 kB of JSON out
    plain = request(served.socket, "POST", "/v2/models/tiny/infer", infer_body(x))
    assert plain[0] == 200, plain[1]
    assert plain[2].getheader("content-encoding") is None and len(plain[1]) > 4096
    for accept, enc, unpack in (
        ("gzip", "gzip", gzip.decompress),
        ("deflate", "deflate", zlib.decompress),
        ("br;q=1.0, deflate;q=0.5, gzip;q=0", "deflate", zlib.decompress),
    ):
        status, data, resp = request(
            served.socket, "POST", "/v2/models/tiny/infer", infer_body(x), {"Accept-Encoding": accept}
        )
        assert status == 200 and resp.getheader("content-encoding") == enc, accept
        assert int(resp.getheader("content-length", "0")) == len(data) < len(plain[1])
        assert unpack(data) == plain[1]
        assert resp.getheader("vary") == "accept-encoding"
    # Binary outputs too; Inference-Header-Content-Length still counts the uncompressed JSON.
    body = orjson.loads(infer_body(x))
    body["parameters"] = {"binary_data_output": True}
    status, data, resp = request(
        served.socket, "POST", "/v2/models/tiny/infer", orjson.dumps(body), {"Accept-Encoding": "gzip"}
    )
    assert status == 200 and resp.getheader("content-encoding") == "gzip"
    raw = gzip.decompress(data)
    n = int(resp.getheader("inference-header-content-length", "0"))
    meta = json.loads(raw[:n])
    assert meta["outputs"][0]["parameters"]["binary_data_size"] == len(raw) - n == 512 * 4 * 4
    got = np.frombuffer(raw[n:], np.float32).reshape(512, 4)
    want = np.asarray(orjson.loads(plain[1])["outputs"][0]["data"], np.float32).reshape(512, 4)
    np.testing.assert_array_equal(got, want)
    # A small answer is not worth compressing.
    status, data, resp = request(
        served.socket, "POST", "/v2/models/tiny/infer", infer_body(x[:1]), {"Accept-Encoding": "gzip"}
    )
    assert status == 200 and resp.getheader("content-encoding") is None and orjson.loads(data)["outputs"]


# --- shared memory parameters ------------------------------------------------------------------


def _shm_request(inp_params: dict[str, Any] | None, out_params: dict[str, Any] | None, data: bool) -> bytes:
    inp: dict[str, Any] = {"name": "x", "shape": [1, 16], "datatype": "FP32"}
    if data:
        inp["data"] = [0.0] * 16
    if inp_params is not None:
        inp["parameters"] = inp_params
    doc: dict[str, Any] = {"inputs": [inp]}
    if out_params is not None:
        doc["outputs"] = [{"name": "probs", "parameters": out_params}]
    return orjson.dumps(doc)


def test_shared_memory_parameter_rules(served: DaemonProcess) -> None:
    """The extension's rules: region and byte size go together (offset is optional), and an input
    in shared memory has no 'data'. Checked before any region is looked up."""
    region: dict[str, Any] = {"shared_memory_region": "r", "shared_memory_byte_size": 64}
    cases: list[tuple[dict[str, Any] | None, dict[str, Any] | None, bool, str]] = [
        (region, None, True, "give one of"),
        ({"shared_memory_byte_size": 64}, None, True, "without 'shared_memory_region'"),
        ({"shared_memory_offset": 0}, None, True, "without 'shared_memory_region'"),
        ({"shared_memory_region": "r"}, None, False, "needs 'shared_memory_byte_size'"),
        ({"shared_memory_region": "r", "shared_memory_byte_size": -1}, None, False, "non-negative integer"),
        (dict(region, binary_data_size=64), None, False, "give one of"),
        (None, {"shared_memory_byte_size": 16}, True, "without 'shared_memory_region'"),
        (None, {"shared_memory_offset": 4}, True, "without 'shared_memory_region'"),
        (None, {"shared_memory_region": "r"}, True, "needs 'shared_memory_byte_size'"),
    ]
    for inp, out, data, words in cases:
        status, answer, _ = request(served.socket, "POST", "/v2/models/tiny/infer", _shm_request(inp, out, data))
        assert (status, code(answer)) == (400, "bad_request"), (inp, out, answer)
        assert words in orjson.loads(answer)["error"], (words, answer)
    # A region that is not registered: the region's own error, once the parameters are right.
    status, answer, _ = request(served.socket, "POST", "/v2/models/tiny/infer", _shm_request(region, None, False))
    assert (status, code(answer)) == (400, "shm_region_not_found")
    # Unregistering what is not registered succeeds (Triton's behaviour), every time.
    for path in ("/v2/systemsharedmemory/region/never/unregister", "/v2/systemsharedmemory/unregister"):
        for _ in range(2):
            assert request(served.socket, "POST", path)[0] == 200
