"""The configuration with a Triton model repository joined to it.

``load_config`` reads the TOML as ``edged.config.load`` does, then the repository it names
(``[server] model_repository``, or ``edged serve --model-repository``): every model folder is
translated (``translate``), edged.toml merged onto it (``overrides``), and each served version
validated as a ``[models.*]`` table. A model in both the repository and ``[models.*]`` is an
error: one name, one model.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from edged.config import Config, ModelConfig, RepositoryModel, convert_model, finish_model, load
from edged.errors import ConfigError
from edged.repository import overrides, plans
from edged.repository.translate import translate_model


def model_folders(root: Path) -> list[Path]:
    """Every model of the repository: its folders, but hidden ones."""
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError as e:
        raise ConfigError(f"{root}: cannot read the model repository: {e.strerror}") from None
    return [Path(e.path) for e in entries if e.is_dir() and not e.name.startswith(".")]


def read_repository(
    root: Path, identity: plans.Identity = plans.tensorrt_identity
) -> tuple[dict[str, ModelConfig], dict[str, RepositoryModel]]:
    """Every served version of every model in ``root``, by the name edged serves it under."""
    if not root.is_dir():
        raise ConfigError(f"{root}: the model repository is not a folder")
    tables = overrides.read(root)
    folders = model_folders(root)
    unknown = sorted(set(tables) - {f.name for f in folders})
    if unknown:
        raise ConfigError(f"{root / overrides.FILE}: models.{unknown[0]}: the repository has no such model")
    models: dict[str, ModelConfig] = {}
    origins: dict[str, RepositoryModel] = {}
    for folder in folders:
        table = tables.get(folder.name)
        for served in translate_model(folder, identity):
            if table is None:
                raw, source = served.raw, str(folder / "config.pbtxt")
            else:
                source = str(root / overrides.FILE)
                raw = overrides.merge(served, table, folder.name, source)
            model = convert_model(raw, folder.name, source)
            models[served.name] = finish_model(model, root)
            origins[served.name] = served.origin
    return models, origins


def load_config(
    path: str | os.PathLike[str], repository: str = "", identity: plans.Identity = plans.tensorrt_identity
) -> Config:
    """``edged.config.load(path)`` with the model repository's models joined; ``repository``
    (a command line's) takes the place of ``[server] model_repository``."""
    cfg = load(path)
    if repository:
        root = Path(os.path.expanduser(repository)).resolve()
    elif cfg.server.model_repository:
        root = Path(cfg.server.model_repository)
    else:
        return cfg
    models, origins = read_repository(root, identity)
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
