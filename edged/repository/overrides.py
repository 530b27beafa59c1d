"""``<repository>/edged.toml``: edged's own keys per model, merged onto what config.pbtxt says.

It holds ``[models.NAME]`` tables only, NAME a model of the repository; their keys are those of
the main config's ``[models.*]`` but ``path`` (the version folders decide it). A table applies to
every served version of its model. A key config.pbtxt already decides (instances from
instance_group, max_batch from max_batch_size...) may be given only with the same value: a
different one is an error naming both. A profile may narrow what config.pbtxt's dims allow,
never widen it. Relative paths are relative to the repository.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from edged.config import read_toml
from edged.errors import ConfigError
from edged.repository.translate import Served

FILE = "edged.toml"
# Tables whose keys are compared one by one; any other value is compared whole.
_TABLES = ("tensorrt", "llm", "gate", "calibration", "warmup")


def read(root: Path) -> dict[str, dict[str, Any]]:
    """edged.toml's model tables by name ({} without the file)."""
    path = root / FILE
    if not path.exists():
        return {}
    doc = read_toml(path, "the repository's edged.toml")
    other = [k for k in doc if k != "models"]
    if other:
        raise ConfigError(f"{path}: {other[0]}: only [models.NAME] tables belong here (the rest is the main config's)")
    models = doc.get("models", {})
    if not isinstance(models, Mapping) or not all(isinstance(t, Mapping) for t in models.values()):
        raise ConfigError(f"{path}: models: expected [models.NAME] tables")
    return {name: dict(table) for name, table in models.items()}


def merge(served: Served, table: Mapping[str, Any], model: str, source: str) -> dict[str, Any]:
    """``served``'s table with ``table`` (edged.toml's for ``model``) merged onto it."""
    where = f"{source}: models.{model}"
    if "path" in table:
        raise ConfigError(f"{where}.path: a repository model's file is its version folder's, not edged.toml's")
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in served.raw.items()}
    for key, value in table.items():
        if key == "profiles":
            raw["profiles"] = _profiles(served, value, where)
        elif key in _TABLES and isinstance(value, Mapping):
            sub = raw.setdefault(key, {})
            for k, v in value.items():
                _agree(served, f"{key}.{k}", sub.get(k), v, where)
                sub[k] = v
        else:
            _agree(served, key, raw.get(key), value, where)
            raw[key] = value
    return raw


def _agree(served: Served, key: str, ours: Any, theirs: Any, where: str) -> None:
    said = served.notes.get(key)
    if said is not None and ours != theirs:
        raise ConfigError(f"{where}.{key} = {theirs!r} contradicts config.pbtxt's {said} (which makes it {ours!r})")


def _profiles(served: Served, value: Any, where: str) -> dict[str, Any]:
    """edged.toml's profiles, each within the bounds config.pbtxt's dims give its input."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}.profiles: expected a table of input tables")
    derived = dict(served.raw.get("profiles", {}))
    for name, prof in value.items():
        bound = derived.get(name)
        if bound is not None and isinstance(prof, Mapping) and not _within(prof, bound):
            raise ConfigError(
                f"{where}.profiles.{name}: min {prof.get('min')} / max {prof.get('max')} go beyond config.pbtxt's "
                f"{served.notes[f'profiles.{name}']} (min {bound['min']}, max {bound['max']})"
            )
        derived[name] = prof
    return derived


def _within(prof: Mapping[str, Any], bound: Mapping[str, list[int]]) -> bool:
    lo, hi = prof.get("min"), prof.get("max")
    if not isinstance(lo, list) or not isinstance(hi, list) or len(lo) != len(bound["min"]) or len(hi) != len(lo):
        return False  # a shape of another rank: refused here, where both are known
    return all(b_lo <= a and b <= b_hi for a, b, b_lo, b_hi in zip(lo, hi, bound["min"], bound["max"]))
