"""Reading TOML into the tree: msgspec's errors turned into key paths, paths made absolute."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from edged.config.base import DEFAULT_CONFIG
from edged.config.checks import check_model, check_sizes
from edged.config.models import ModelConfig, ShapeProfile
from edged.config.sizes import parse_size
from edged.config.tree import DERIVED_KEYS, Config
from edged.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 (JetPack 6)
    import tomli as tomllib

_PATH_RE = re.compile(r" - at `\$(.*)`$")
_UNKNOWN_RE = re.compile(r"^Object contains unknown field `([^`]*)`")


def _key_path(msgspec_path: str) -> str:
    """``$.models.detector[...]`` → ``models.detector``; list indexes stay as ``[0]``."""
    return re.sub(r"\['([^']*)'\]", r".\1", msgspec_path).lstrip(".")


def _explain(err: msgspec.ValidationError, source: str) -> ConfigError:
    text = str(err)
    m = _PATH_RE.search(text)
    path = _key_path(m.group(1)) if m else ""
    msg = text[: m.start()] if m else text
    unknown = _UNKNOWN_RE.match(msg)
    if unknown:
        path = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
        msg = "unknown key"
    elif msg.startswith("Object missing required field"):
        field = msg.split("`")[1]
        path = f"{path}.{field}" if path else field
        msg = "required key is missing"
    return ConfigError(f"{source}: {path or '(top level)'}: {msg}")


def _convert(raw: Any, typ: type[Any], source: str, prefix: str) -> Any:
    try:
        return msgspec.convert(raw, type=typ)
    except msgspec.ValidationError as e:
        err = _explain(e, source)
        if prefix:
            head, _, rest = err.message.partition(": ")
            key, _, msg = rest.partition(": ")
            key = prefix if key == "(top level)" else f"{prefix}.{key}"
            err = ConfigError(f"{head}: {key}: {msg}")
        raise err from None


def _convert_model(raw: Any, source: str, prefix: str) -> ModelConfig:
    """Models and their profiles are keyed by name; converting them one by one keeps the name
    in the key path (msgspec reports dict keys as ``[...]``)."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{source}: {prefix}: expected a table")
    profiles_raw = raw.get("profiles", {})
    if not isinstance(profiles_raw, Mapping):
        raise ConfigError(f"{source}: {prefix}.profiles: expected a table of input tables")
    model: ModelConfig = _convert(dict(raw, profiles={}), ModelConfig, source, prefix)
    profiles = {inp: _convert(p, ShapeProfile, source, f"{prefix}.profiles.{inp}") for inp, p in profiles_raw.items()}
    return msgspec.structs.replace(model, profiles=profiles)


def _resolve(base: Path, value: str) -> str:
    if not value:
        return value
    p = Path(os.path.expanduser(value))
    return str(p if p.is_absolute() else (base / p).resolve())


def finish_model(m: ModelConfig, base: Path) -> ModelConfig:
    """A checked model with its paths resolved against ``base`` (the folder of the file that
    named them) and a language model's instances set to its slots."""
    cal = m.calibration
    if cal is not None:
        cal = msgspec.structs.replace(cal, data=_resolve(base, cal.data))
    warm = m.warmup
    if isinstance(warm.inputs, dict):
        inputs = {k: msgspec.structs.replace(v, file=_resolve(base, v.file)) for k, v in warm.inputs.items()}
        warm = msgspec.structs.replace(warm, inputs=inputs)
    elif warm.inputs != "random":
        warm = msgspec.structs.replace(warm, inputs=_resolve(base, warm.inputs))
    # A language model runs one instance per slot.
    instances = m.llm.slots if m.llm is not None else m.instances
    return msgspec.structs.replace(m, path=_resolve(base, m.path), calibration=cal, warmup=warm, instances=instances)


def _with_paths(cfg: Config, base: Path, source: str) -> Config:
    models = {name: finish_model(m, base) for name, m in cfg.models.items()}
    mqtt = cfg.mqtt
    if mqtt.tls is not None:
        tls = mqtt.tls
        mqtt = msgspec.structs.replace(
            mqtt,
            tls=msgspec.structs.replace(
                tls,
                ca=_resolve(base, tls.ca),
                cert=_resolve(base, tls.cert),
                key=_resolve(base, tls.key),
            ),
        )
    return msgspec.structs.replace(
        cfg,
        server=msgspec.structs.replace(
            cfg.server,
            socket=_resolve(base, cfg.server.socket),
            grpc_socket=cfg.server.grpc_socket
            if cfg.server.grpc_socket in ("", "none")
            else _resolve(base, cfg.server.grpc_socket),
            tcp_token_file=_resolve(base, cfg.server.tcp_token_file),
            model_repository=_resolve(base, cfg.server.model_repository),
        ),
        cache=msgspec.structs.replace(cfg.cache, dir=_resolve(base, cfg.cache.dir)),
        mqtt=mqtt,
        models=models,
        fleet=cfg.fleet.resolved(base),
        source=source,
    )


def from_mapping(raw: Mapping[str, Any], source: str = "<config>", base: Path | None = None) -> Config:
    """Validate an already-parsed TOML document (tests and reload use this directly)."""
    for key in DERIVED_KEYS:
        if key in raw:
            raise ConfigError(f"{source}: {key}: unknown key")
    cfg = _convert(dict(raw, models={}), Config, source, "")
    models_raw = raw.get("models", {})
    if not isinstance(models_raw, Mapping):
        raise ConfigError(f"{source}: models: expected a table of [models.NAME] tables")
    models = {name: _convert_model(m, source, f"models.{name}") for name, m in models_raw.items()}
    cfg = msgspec.structs.replace(cfg, models=models)
    check_sizes(cfg, source)
    for name, model in cfg.models.items():
        check_model(name, model, source)
    return _with_paths(cfg, base or Path.cwd(), source)


def read_toml(path: str | os.PathLike[str], what: str = "config") -> dict[str, Any]:
    """One TOML file as a document; a failure is a ConfigError naming the file."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"{p}: cannot read {what}: {e.strerror}") from None
    try:
        return tomllib.loads(data.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from None


def load(path: str | os.PathLike[str]) -> Config:
    """Read and validate one config file; every failure is a ConfigError naming the file."""
    p = Path(path)
    return from_mapping(read_toml(p), str(p), p.resolve().parent)


def convert_model(raw: Any, name: str, source: str) -> ModelConfig:
    """One ``[models.NAME]`` table, validated and checked as ``load`` does, errors naming
    ``source`` and ``models.NAME``; its paths are not resolved yet (``finish_model``)."""
    model = _convert_model(raw, source, f"models.{name}")
    check_model(name, model, source)
    sizes = {"tensorrt.workspace": model.tensorrt.workspace}
    for key, value in sizes.items():
        try:
            parse_size(value)
        except ValueError as e:
            raise ConfigError(f"{source}: models.{name}.{key}: {e}") from None
    return model


def default_config_path() -> str:
    return os.environ.get("EDGED_CONFIG") or DEFAULT_CONFIG


def max_body_bytes(cfg: Config) -> int:
    return parse_size(cfg.server.max_body)
