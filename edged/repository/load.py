"""The configuration with a Triton model repository joined to it.

``load_config`` reads the TOML as ``edged.config.load`` does, then the repository it names
(``[server] model_repository``, or ``edged serve --model-repository``): every model folder is
translated (``translate``), edged.toml merged onto it (``overrides``), and each served version
validated as a ``[models.*]`` table. A model in both the repository and ``[models.*]`` is an
error: one name, one model.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from edged.config import Config, ModelConfig, RepositoryModel, convert_model, finish_model, load
from edged.errors import ConfigError
from edged.repository import overrides, plans
from edged.repository.translate import Override, translate_model


def model_folders(root: Path) -> list[Path]:
    """Every model of the repository: its folders, but hidden ones."""
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError as e:
        raise ConfigError(f"{root}: cannot read the model repository: {e.strerror}") from None
    return [Path(e.path) for e in entries if e.is_dir() and not e.name.startswith(".")]


def read_repository(
    root: Path,
    identity: plans.Identity = plans.tensorrt_identity,
    replaced: Mapping[str, Override] | None = None,
) -> tuple[dict[str, ModelConfig], dict[str, RepositoryModel]]:
    """Every served version of every model in ``root``, by the name edged serves it under;
    ``replaced``: models whose configuration (and files) a load request gave instead."""
    if not root.is_dir():
        raise ConfigError(f"{root}: the model repository is not a folder")
    # A configured model whose folder left the repository leaves with it (uploaded files stay).
    replaced = {n: o for n, o in (replaced or {}).items() if o.uploaded or (root / n).is_dir()}
    tables = overrides.read(root)
    folders = {f.name: f for f in model_folders(root)}
    names = sorted(set(folders) | set(replaced))
    unknown = sorted(set(tables) - set(names))
    if unknown:
        raise ConfigError(f"{root / overrides.FILE}: models.{unknown[0]}: the repository has no such model")
    models: dict[str, ModelConfig] = {}
    origins: dict[str, RepositoryModel] = {}
    for name in names:
        for served, model, origin in read_model(
            root, name, folders.get(name), tables.get(name), identity, replaced.get(name)
        ):
            models[served], origins[served] = model, origin
    return models, origins


def read_model(
    root: Path,
    name: str,
    folder: Path | None,
    table: Mapping[str, Any] | None,
    identity: plans.Identity = plans.tensorrt_identity,
    over: Override | None = None,
) -> list[tuple[str, ModelConfig, RepositoryModel]]:
    """One model of the repository: each served version's name, table and origin; ``table`` its
    edged.toml table, ``over`` what a load request gave in place of ``folder``."""
    if over is not None:
        every, where = translate_model(over.folder, identity, over.given), over.given.where
    else:
        assert folder is not None
        every, where = translate_model(folder, identity), str(folder / "config.pbtxt")
    out = []
    for served in every:
        raw, source = served.raw, where
        if table is not None:
            source = str(root / overrides.FILE)
            raw = overrides.merge(served, table, name, source)
        model = convert_model(raw, name, source)
        origin = served.origin
        if over is not None:  # status says why the model is not what its config.pbtxt says
            said = "configured by a load request" + (" with uploaded files" if over.uploaded else "")
            origin = msgspec.structs.replace(origin, note=f"{said}; {origin.note}" if origin.note else said)
        out.append((served.name, finish_model(model, root), origin))
    return out


def load_config(
    path: str | os.PathLike[str],
    repository: str = "",
    identity: plans.Identity = plans.tensorrt_identity,
    replaced: Mapping[str, Override] | None = None,
) -> Config:
    """``edged.config.load(path)`` with the model repository's models joined; ``repository``
    (a command line's) takes the place of ``[server] model_repository``; ``replaced`` as
    ``read_repository``'s."""
    cfg = load(path)
    if repository:
        root = Path(os.path.expanduser(repository)).resolve()
    elif cfg.server.model_repository:
        root = Path(cfg.server.model_repository)
    else:
        return cfg
    models, origins = read_repository(root, identity, replaced)
    both = sorted({o.model for o in origins.values()} & set(cfg.models))
    if both:
        raise ConfigError(
            f"{cfg.source}: models.{both[0]}: the model repository {root} has a model '{both[0]}' too; "
            "one name is one model: rename one of them"
        )
    return msgspec.structs.replace(
        cfg,
        server=msgspec.structs.replace(cfg.server, model_repository=str(root)),
        models={**cfg.models, **models},
        repository=origins,
        repository_arg=str(root) if repository else "",  # resolved: a reload reads the same folder
    )
