"""The requests the fuzzer sends (bench/fuzz.py): valid infer requests for the tiny model and a
two-input model, mutated at the document and at the byte level; a few hostile floods; BYTES
tensors with broken framing; bodies compressed with encodings edged reads and ones it does not.
Each case is made from a seeded ``random.Random``, so a seed replays the same requests.
"""

from __future__ import annotations

import gzip
import os
import random
import zlib
from typing import Any

import numpy as np
import orjson

REGION = "fuzz"  # the shared memory region the fuzzer registers with the daemon before the cases

NASTY: list[Any] = [
    None,
    True,
    -1,
    0,
    2**31,
    2**63 - 1,
    1.5,
    "",
    "x",
    "FP32",
    [],
    [-1],
    [2**62, 2**62],
    [[]],
    {},
    {"a": 1},
    "\u0000",
    "😀" * 3,
]
KEYS = ["name", "shape", "datatype", "data", "parameters", "inputs", "outputs", "id", "binary_data_size"]
PARAM_KEYS = [
    "binary_data_size",
    "binary_data",
    "binary_data_output",
    "shared_memory_region",
    "shared_memory_byte_size",
    "shared_memory_offset",
]
HEADER_LENGTHS = ["+{n}", " {n}", "{n} ", "{n}_0", "0x{n}", "-{n}", "{n}.0", "1" * 40, "", "٣"]


def _valid(rng: random.Random) -> tuple[str, dict[str, Any], bytes]:
    """A valid request (model, JSON header document, binary tail) to mutate."""
    rows = rng.choice([1, 1, 2, 5])
    kind = rng.choice(["json", "binary", "shm", "pair"])
    if kind == "pair":
        a, b = np.ones((rows, 8), np.float32), np.ones((rows, 8), np.float32)
        inputs = [
            {"name": n, "shape": [rows, 8], "datatype": "FP32", "data": v.reshape(-1).tolist()}
            for n, v in [("a", a), ("b", b)]
        ]
        return "pair", {"inputs": inputs}, b""
    x = np.random.default_rng(rng.randrange(1 << 30)).random((rows, 16), dtype=np.float32)
    inp: dict[str, Any] = {"name": "x", "shape": [rows, 16], "datatype": "FP32"}
    doc: dict[str, Any] = {"id": str(rng.randrange(1000)), "inputs": [inp]}
    if rng.random() < 0.5:
        doc["outputs"] = [{"name": "probs", "parameters": {"binary_data": rng.random() < 0.5}}]
    if kind == "json":
        inp["data"] = x.reshape(-1).tolist()
        return "tiny", doc, b""
    if kind == "binary":
        inp["parameters"] = {"binary_data_size": x.nbytes}
        return "tiny", doc, x.tobytes()
    inp["parameters"] = {"shared_memory_region": REGION, "shared_memory_byte_size": x.nbytes, "shared_memory_offset": 0}
    return "tiny", doc, b""


def _mutate_doc(rng: random.Random, node: Any, depth: int = 0) -> Any:
    """One structural change somewhere in the document."""
    if isinstance(node, dict) and node and (depth < 4 and rng.random() < 0.7):
        key = rng.choice(list(node))
        node[key] = _mutate_doc(rng, node[key], depth + 1)
        return node
    if isinstance(node, list) and node and (depth < 4 and rng.random() < 0.7):
        i = rng.randrange(len(node))
        node[i] = _mutate_doc(rng, node[i], depth + 1)
        return node
    op = rng.randrange(6)
    if op == 0:
        return rng.choice(NASTY)
    if op == 1 and isinstance(node, dict):
        node.pop(rng.choice(list(node)), None) if node else None
        return node
    if op == 2 and isinstance(node, dict):
        node[rng.choice(KEYS + PARAM_KEYS)] = rng.choice([*NASTY, REGION, 64, 4096])
        return node
    if op == 3 and isinstance(node, list):
        return node + node[: rng.randrange(1, 3)]  # duplicates
    if op == 4 and isinstance(node, int) and not isinstance(node, bool):
        return node + rng.choice([-1, 1, 2**32, -(2**20)])
    return rng.choice(NASTY)


def _mutate_bytes(rng: random.Random, body: bytes) -> bytes:
    buf = bytearray(body)
    for _ in range(rng.randrange(1, 5)):
        if not buf:
            break
        at = rng.randrange(len(buf))
        op = rng.randrange(4)
        if op == 0:
            buf[at] ^= 1 << rng.randrange(8)
        elif op == 1:
            buf.insert(at, rng.choice(b'{}[]",:0-9eE.\\ \x00\xff'))
        elif op == 2:
            del buf[at]
        else:
            del buf[at:]
    return bytes(buf)


def _flood(rng: random.Random) -> tuple[str, bytes, dict[str, str]]:
    """A large hostile body: many names, one output listed many times, deep nesting."""
    x = {"name": "x", "shape": [1, 16], "datatype": "FP32", "data": [0.0] * 16}
    kind = rng.randrange(3)
    if kind == 0:
        doc: Any = {"inputs": [dict(x, name=f"n{i}") for i in range(40_000)]}
    elif kind == 1:
        doc = {"inputs": [x], "outputs": [{"name": "probs"}] * 200_000}
    else:
        return "tiny", b'{"inputs":' + b"[" * 100_000 + b"]" * 100_000 + b"}", {}
    return "tiny", orjson.dumps(doc), {}


ENCODINGS = ["gzip", "deflate", "x-gzip", "identity", "br", "gzip, gzip", "GZIP", "", "zstd"]


def _bytes_case(rng: random.Random) -> tuple[str, dict[str, Any], bytes]:
    """A BYTES tensor (length-prefixed elements, some framing broken) for a model that takes
    floats: refused before its elements are read."""
    count = rng.choice([1, 3, 1000, 100_000])
    tail = b"".join(len(e).to_bytes(4, "little") + e for e in (b"ab",) * count)
    if rng.random() < 0.5:
        tail = _mutate_bytes(rng, tail)
    params = {"binary_data_size": len(tail)}
    doc = {"inputs": [{"name": "x", "shape": [count], "datatype": "BYTES", "parameters": params}]}
    return "tiny", doc, tail


def _compress(rng: random.Random, body: bytes, valid: bool) -> tuple[bytes, dict[str, str], bool]:
    """The body compressed as the Content-Encoding header says (or says wrongly)."""
    encoding = rng.choice(ENCODINGS)
    if encoding in ("gzip", "x-gzip", "GZIP"):
        body = gzip.compress(body, 1)
    elif encoding == "deflate":
        body = zlib.compress(body, 1)
    readable = encoding in ("gzip", "x-gzip", "GZIP", "deflate", "identity", "")
    if rng.random() < 0.2:
        body, readable = _mutate_bytes(rng, body), False
    return body, {"Content-Encoding": encoding}, valid and readable


def make_case(rng: random.Random) -> tuple[str, bytes, dict[str, str], bool]:
    """(model, body, extra headers, whether the request is valid as generated)."""
    if rng.random() < 0.001:
        return (*_flood(rng), False)
    if rng.random() < 0.03:
        model, doc, tail = _bytes_case(rng)
        header = orjson.dumps(doc)
        return model, header + tail, {"Inference-Header-Content-Length": str(len(header))}, False
    model, doc, tail = _valid(rng)
    valid = rng.random() < 0.05
    if not valid:
        if rng.random() < 0.6:
            doc = _mutate_doc(rng, doc)
        elif tail and rng.random() < 0.5:
            tail = _mutate_bytes(rng, tail) if rng.random() < 0.5 else tail + os.urandom(rng.randrange(1, 64))
    header = orjson.dumps(doc)
    headers: dict[str, str] = {}
    if tail or rng.random() < 0.1:
        length = len(header)
        if not valid and rng.random() < 0.15:
            headers["Inference-Header-Content-Length"] = rng.choice(HEADER_LENGTHS).format(n=length)
        else:
            headers["Inference-Header-Content-Length"] = str(
                length + (0 if valid else rng.choice([0, 0, 1, -1, 10**6]))
            )
    body = header + tail
    if not valid and rng.random() < 0.3:
        body = _mutate_bytes(rng, body)
    if not valid and rng.random() < 0.02:
        model = rng.choice(["nope", "tiny/versions/1", "tiny/versions/2", "pair", "tiny"])
    if rng.random() < 0.1:
        body, extra, valid = _compress(rng, body, valid)
        headers.update(extra)
    return model, body, headers, valid
