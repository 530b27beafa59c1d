"""Saved prefix states: one file per kept prefix, beside the model's cache entry.

A file is a magic, a JSON header and llama.cpp's sequence state (its KV cells, from
``llama_state_seq_get_data``). The header names what the state is bound to (the cache entry,
whose key covers the GGUF's digest and the llama.cpp build; the build's system info; the prefix
tokens) and what it must reproduce: the digest of the state bytes and the next-token logits that
the freshly prefilled prefix gave. Reading checks every one of those before a byte reaches
llama.cpp; the engine then checks the restored cells themselves (their positions, and the
logits of a one-token recompute on top of them). Nothing here is trusted because it parses.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edged.cache.store import EngineCache, atomic_write

log = logging.getLogger(__name__)

MAGIC = b"EDGEDKV1"
_LEN = struct.Struct("<I")
MAX_HEADER = 4 << 20  # tokens and a few logits: far below this


class StateFileError(Exception):
    """A state file that does not check out: moved to the quarantine, the prefix recomputed."""


@dataclass(frozen=True)
class SavedState:
    tokens: tuple[int, ...]
    state: bytes
    logits: tuple[tuple[int, float], ...]  # the top next-token logits after the prefix


def directory(artifact: Path) -> Path:
    """Where a model's states live: beside its cache entry, removed with it."""
    return artifact.parent / f"{artifact.name.removesuffix('.llm.json')}.prefixes"


def write(path: Path, binding: dict[str, Any], saved: SavedState) -> None:
    header = dict(
        binding,
        version=1,
        tokens=list(saved.tokens),
        logits=[[t, v] for t, v in saved.logits],
        state_bytes=len(saved.state),
        sha256=hashlib.sha256(saved.state).hexdigest(),
    )
    head = json.dumps(header, separators=(",", ":")).encode()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
    atomic_write(path, MAGIC + _LEN.pack(len(head)) + head + saved.state)


def read(path: Path, binding: dict[str, Any], limit: int) -> SavedState:
    """The state in ``path`` if it is whole and bound to ``binding``; ``limit``: the most state
    bytes this model's prefixes can take (a larger file is not read)."""
    try:
        size = path.stat().st_size
        if size > limit + MAX_HEADER:
            raise StateFileError(f"{size} bytes, more than any prefix of this model")
        data = path.read_bytes()
    except OSError as e:
        raise StateFileError(f"unreadable: {e}") from e
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _LEN.size:
        raise StateFileError("not an edged prefix state")
    (n,) = _LEN.unpack_from(data, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    if n > MAX_HEADER or start + n > len(data):
        raise StateFileError("header length out of range")
    try:
        header = json.loads(data[start : start + n])
    except ValueError as e:
        raise StateFileError(f"header is not JSON: {e}") from e
    if not isinstance(header, dict) or header.get("version") != 1:
        raise StateFileError("unknown header version")
    for key, want in binding.items():
        if header.get(key) != want:
            raise StateFileError(f"made for another {key} ({header.get(key)!r}, this is {want!r})")
    state = data[start + n :]
    if header.get("state_bytes") != len(state) or header.get("sha256") != hashlib.sha256(state).hexdigest():
        raise StateFileError("state bytes do not match their digest")
    try:
        tokens = tuple(int(t) for t in header["tokens"])
        logits = tuple((int(t), float(v)) for t, v in header["logits"])
    except (KeyError, TypeError, ValueError) as e:
        raise StateFileError(f"header fields malformed: {e}") from e
    if not tokens or not logits:
        raise StateFileError("header without tokens or logits")
    return SavedState(tokens, state, logits)


def quarantine(path: Path, reason: str) -> None:
    """Move a bad state aside as the cache moves a bad engine (bounded by the cache's collector)."""
    EngineCache(path.parent.parent).quarantine(path, f"prefix state: {reason}")


def saved_files(folder: Path) -> list[Path]:
    """The state files of a model, newest first."""
    try:
        files = [p for p in folder.iterdir() if p.suffix == ".kv" and p.is_file()]
    except OSError:
        return []
    return sorted(files, key=lambda p: p.stat().st_mtime, reverse=True)
