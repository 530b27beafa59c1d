"""A load request's files placed as a model's folder, under ``{cache.dir}/uploads``.

Each load gets a folder of its own, written under a temporary name and renamed into place, so a
reload never sees half of one; files are created exclusively (no links followed, no file written
twice) and readable by the daemon's user only. An ONNX model's external data must lie inside the
folder: ONNX Runtime checks that too, but not every release edged runs on, nor TensorRT's parser.
Uploads last until the model is loaded from elsewhere or the daemon restarts (as in Triton).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import onnx

from edged.config import NAME_RE
from edged.errors import BadRequestError, RepositoryPollError
from edged.repository.plans import ENGINE_SUFFIXES

AREA = "uploads"


def place(area: Path, name: str, files: Mapping[str, bytes]) -> Path:
    """``files`` (paths checked by load_request.check_path) as a new folder of ``area``; ``name``
    a model's (NAME_RE: no path in it)."""
    if not NAME_RE.match(name):
        raise BadRequestError(f"failed to load: {name[:80]!r} is not a model's name")
    refuse_plans(name, files)
    area.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=area))
    try:
        for rel, data in files.items():
            _write(tmp, rel, data, name)
        folder = Path(tempfile.mkdtemp(prefix=f"{name}.", dir=area))
        os.replace(tmp, folder)  # an empty folder is replaced whole
    except BaseException:
        remove(tmp)
        raise
    return folder


def refuse_plans(name: str, files: Mapping[str, bytes]) -> None:
    plans = sorted(p for p in files if p.lower().endswith(ENGINE_SUFFIXES))
    if plans:
        raise BadRequestError(
            f"failed to load '{name}': file:{plans[0]}: edged builds TensorRT engines on this device from the "
            "model.onnx (an engine from elsewhere is deserialized unchecked): upload the ONNX model"
        )


def _write(root: Path, rel: str, data: bytes, name: str) -> None:
    target = root / rel
    try:
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise RepositoryPollError(
            f"failed to load '{name}': failed to poll from model repository: file:{rel}: {e.strerror}"
        ) from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def check_external_data(folder: Path, path: Path, name: str) -> None:
    """The ONNX model at ``path`` keeps its external data inside ``folder``."""
    where = path.relative_to(folder) if path.is_relative_to(folder) else path
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # onnx raises DecodeError and others for what is not a model
        raise BadRequestError(f"failed to load '{name}': {where}: not an ONNX model: {e}") from None
    inside = folder.resolve()
    for tensor in _tensors(model.graph):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        target = (path.parent / location).resolve()
        if not location or os.path.isabs(location) or not target.is_relative_to(inside):
            raise BadRequestError(
                f"failed to load '{name}': {where}: tensor '{tensor.name}' keeps its data "
                f"at {location!r}, outside the uploaded files"
            )


def _tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    yield from graph.initializer
    yield from (s.values for s in graph.sparse_initializer)
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _tensors(attr.g)
            for sub in attr.graphs:
                yield from _tensors(sub)


def remove(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def clear(area: Path) -> None:
    """What earlier runs uploaded: gone at start, as Triton's uploads are."""
    if area.is_dir():
        for entry in area.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                remove(entry)
            else:
                entry.unlink(missing_ok=True)
