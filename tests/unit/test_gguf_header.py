"""The GGUF header reader against files written here byte by byte (the format's own layout)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from edged.errors import BuildError
from edged.llm.gguf_header import read_header


def _s(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def gguf(path: Path, kvs: list[bytes], version: int = 3) -> Path:
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", version, 0, len(kvs)) + b"".join(kvs))
    return path


def test_scalars_strings_and_arrays(tmp_path: Path) -> None:
    kvs = [
        _s("general.architecture") + struct.pack("<I", 8) + _s("llama"),
        _s("llama.block_count") + struct.pack("<II", 4, 30),
        _s("llama.rope.freq_base") + struct.pack("<If", 6, 0.5),
        _s("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 3) + _s("a") + _s("bc") + _s("<|im_end|>"),
        _s("tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 6, 2) + struct.pack("<ff", 1.0, 2.0),
        _s("llama.context_length") + struct.pack("<IQ", 10, 8192),
    ]
    h = read_header(str(gguf(tmp_path / "m.gguf", kvs)))
    assert h == {
        "general.architecture": "llama",
        "llama.block_count": 30,
        "llama.rope.freq_base": 0.5,
        "tokenizer.ggml.tokens": 3,
        "tokenizer.ggml.scores": 2,
        "llama.context_length": 8192,
    }


def test_not_a_gguf_or_truncated_is_a_precise_error(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"ONNX" + bytes(32))
    with pytest.raises(BuildError, match="no GGUF magic"):
        read_header(str(tmp_path / "x.gguf"))
    truncated = gguf(
        tmp_path / "t.gguf", [_s("general.architecture") + struct.pack("<I", 8) + struct.pack("<Q", 1 << 40)]
    )
    with pytest.raises(BuildError, match="past the end"):
        read_header(str(truncated))
    huge = gguf(tmp_path / "h.gguf", [_s("k") + struct.pack("<IIQ", 9, 8, 1 << 50)])
    with pytest.raises(BuildError, match="not a readable GGUF"):
        read_header(str(huge))
