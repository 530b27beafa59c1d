"""A bundle's two small files: ``bundle.toml`` (name, version, created) and ``model.toml`` (the
model's ``[models.NAME]`` keys), read with bounds and turned into edged's own types.

The version is a PEP 440 version (``1``, ``1.4.2``, ``2026.6.1``), compared with packaging's
rules, so that an agent can tell a replayed older bundle from the newer one it replaces.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import msgspec
from packaging.version import InvalidVersion, Version

from edged.config import NAME_RE, ModelConfig, convert_model, finish_model, tomllib
from edged.errors import ConfigError
from edged.fleet.bundle_base import (
    MAX_METADATA_BYTES,
    MAX_MODEL_TABLE_BYTES,
    METADATA,
    MODEL_TABLE,
    BundleRefused,
    read_bounded,
)

FORMAT = 1
MODEL_SUFFIXES = (".onnx", ".gguf")


class BundleMeta(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    format: int = FORMAT
    name: str
    version: str
    created: dt.datetime


def parse_version(text: str) -> Version:
    """A bundle's version as a comparable value; ValueError when it is not PEP 440."""
    try:
        return Version(text)
    except InvalidVersion:
        raise ValueError(f"version {text!r} is not a PEP 440 version such as '1.4.2'") from None


def read_toml_bounded(path: Path, limit: int, code: str) -> dict[str, Any]:
    data = read_bounded(path, limit, path.name, code)
    try:
        return tomllib.loads(data.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise BundleRefused(f"{path.name}: not valid TOML: {e}", code) from None


def read_meta(root: Path) -> BundleMeta:
    raw = read_toml_bounded(root / METADATA, MAX_METADATA_BYTES, "metadata_invalid")
    try:
        meta = msgspec.convert(raw, type=BundleMeta)
    except msgspec.ValidationError as e:
        raise BundleRefused(f"{METADATA}: {e}", "metadata_invalid") from None
    if meta.format != FORMAT:
        raise BundleRefused(f"{METADATA}: format {meta.format}; this edged reads format {FORMAT}", "metadata_invalid")
    if not NAME_RE.match(meta.name):
        raise BundleRefused(
            f"{METADATA}: name {meta.name!r}: 1-64 of [A-Za-z0-9_.-], starting alnum", "metadata_invalid"
        )
    try:
        parse_version(meta.version)
    except ValueError as e:
        raise BundleRefused(f"{METADATA}: {e}", "metadata_invalid") from None
    if meta.created.tzinfo is None:
        raise BundleRefused(f"{METADATA}: created needs a time zone (2026-01-31T12:00:00Z)", "metadata_invalid")
    return meta


def read_model(root: Path, name: str, files: set[str]) -> ModelConfig:
    """The model's table, checked as a ``[models.NAME]`` table is, with every path it names
    resolved inside the bundle and the model file one of the bundle's files."""
    raw = read_toml_bounded(root / MODEL_TABLE, MAX_MODEL_TABLE_BYTES, "config_invalid")
    try:
        model = finish_model(convert_model(raw, name, MODEL_TABLE), root)
    except ConfigError as e:
        raise BundleRefused(e.message, "config_invalid") from None
    top = root.resolve()
    rel = _inside(top, model.path, "path")
    if rel not in files:
        raise BundleRefused(f"{MODEL_TABLE}: path: {rel} is not a file of the bundle", "config_invalid")
    if not rel.endswith(MODEL_SUFFIXES):
        raise BundleRefused(f"{MODEL_TABLE}: path: {rel}: a bundle serves an ONNX or GGUF file", "config_invalid")
    if model.calibration is not None:
        _inside(top, model.calibration.data, "calibration.data")
    warm = model.warmup.inputs
    if isinstance(warm, str) and warm != "random":
        _inside(top, warm, "warmup.inputs")
    elif isinstance(warm, dict):
        for inp, sample in warm.items():
            if sample.file:
                _inside(top, sample.file, f"warmup.inputs.{inp}.file")
    return model


def _inside(top: Path, value: str, key: str) -> str:
    p = Path(value)
    try:
        return p.relative_to(top).as_posix()
    except ValueError:
        raise BundleRefused(f"{MODEL_TABLE}: {key}: {value} is outside the bundle", "config_invalid") from None
