"""The few numbers edged needs from a GGUF file's header: architecture, layers, heads, vocabulary
size, trained context. They size the KV cache that the memory plan admits, before any engine loads.

Read here rather than with the ``gguf`` package: its reader turns every element of every array
(49k tokenizer strings in SmolLM2) into a numpy view, 34 s for a 98 MB file on the test machine,
and the plan runs at boot. This reads the key/value section only, skipping array contents.
"""

from __future__ import annotations

import mmap
import struct
from typing import Any

from edged.errors import BuildError

MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
MAX_KEYS = 1 << 16  # a header with more keys than this is not a model, it is an attack


class _Reader:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError("string runs past the end of the file")
        text = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == STRING:
            return self.string()
        if vtype == ARRAY:
            etype, count = self.take("<I"), self.take("<Q")
            if etype in _SCALARS:
                self.pos += struct.calcsize(_SCALARS[etype]) * count
            elif etype == STRING:
                for _ in range(count):
                    self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]
            else:
                raise ValueError(f"array of type {etype} is not supported")
            if self.pos > len(self.buf):
                raise ValueError("array runs past the end of the file")
            return count  # arrays: their length is all edged needs (the vocabulary size)
        raise ValueError(f"unknown value type {vtype}")


def read_header(path: str) -> dict[str, Any]:
    """Every key of the header; arrays are given as their length."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            r = _Reader(buf)
            if bytes(buf[:4]) != MAGIC:
                raise ValueError("no GGUF magic")
            r.pos = 4
            version, _tensors, n_keys = r.take("<I"), r.take("<Q"), r.take("<Q")
            if version < 2 or n_keys > MAX_KEYS:
                raise ValueError(f"unsupported GGUF version {version} or {n_keys} keys")
            out: dict[str, Any] = {}
            for _ in range(n_keys):
                key = r.string()
                out[key] = r.value(r.take("<I"))
            return out
    except (OSError, ValueError, struct.error) as e:
        raise BuildError(f"{path} is not a readable GGUF file: {e}") from e
