"""Model versions: what each name and version served means, over every transport.

A model of the TOML is served as version 1 under its name. A repository model serves the
versions its policy picks: the latest is registered under the model's name (so that a request
without a version, the usual one, finds it directly), every other as ``NAME@VERSION``. These
tables are worked out once per configuration (``Versions.of_config``).
"""

from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Any

from edged.config import Config, RepositoryModel
from edged.errors import InvalidInputError, ModelNotFoundError, ModelVersionNotFoundError


@dataclass(frozen=True)
class Versions:
    of: dict[str, dict[str, str]]  # repository model → {version: the registry's name}, ascending
    served_as: dict[str, tuple[str, str]]  # the registry's name → (model, version)

    @classmethod
    def of_config(cls, cfg: Config) -> Versions:
        of: dict[str, dict[str, str]] = {}
        for name, origin in sorted(cfg.repository.items(), key=lambda kv: int(kv[1].version)):
            of.setdefault(origin.model, {})[origin.version] = name
        return cls(of, {name: (o.model, o.version) for name, o in cfg.repository.items()})

    def served(self, name: str) -> tuple[str, str]:
        """(model, version) that the registry's ``name`` serves."""
        return self.served_as.get(name, (name, "1"))

    def resolve(self, name: str, version: str, registered: Container[str]) -> str:
        """The registry's name for ``name`` at ``version`` ('' for the default)."""
        served = self.of.get(name)
        model = name
        if served is None:
            if name not in registered:
                raise ModelNotFoundError.named(name)
            model, own = self.served(name)
            served = {own: name}
        if version == "":
            return name
        if not (version.isascii() and version.isdigit()):
            # Triton's words (a version is an integer there), which its example clients match.
            raise InvalidInputError(f"failed to get model version from specified version string '{version[:64]}'")
        found = served.get(version)
        if found is None:
            raise ModelVersionNotFoundError(
                f"model '{model}' has no version '{version[:64]}'; it serves version {', '.join(served)}"
            )
        return found

    def every(self, name: str, registered: Container[str]) -> list[str]:
        """What loading or unloading ``name`` means: each version of a repository model."""
        served = self.of.get(name)
        if served is not None:
            return list(served.values())
        if name not in registered:
            raise ModelNotFoundError.named(name)
        return [name]

    def listed(self, name: str, ready: Callable[[str], bool]) -> list[str]:
        """Model metadata's ``versions``: for a model's default, each version of it that is
        ready (Triton's answer without a version); for another version, that one."""
        model, version = self.served(name)
        if name != model:
            return [version]
        served = self.of.get(model, {version: name})
        return [v for v, n in served.items() if ready(n)] or [version]


def origin_doc(cfg: Config, name: str) -> dict[str, str] | None:
    """Where a repository model comes from, and what edged serves otherwise than it asks."""
    origin = cfg.repository.get(name)
    if origin is None:
        return None
    return {"model": origin.model, "version": origin.version, "folder": origin.folder, "note": origin.note}


def served_config(doc: dict[str, Any], origin: RepositoryModel, max_batch: int, versions: list[str]) -> dict[str, Any]:
    """Triton's model configuration of a repository model as its config.pbtxt gave it to clients
    (DeepStream reads max_batch_size, dims and formats from it): the model's name, the versions
    its policy serves, the batch left out of the dims of a batched model, the dims clients send
    where a reshape differs and each input's format. ``doc``: the answer for edged's own view."""
    skip = 1 if doc["max_batch_size"] > 0 else 0
    lead = 1 if origin.batched else 0
    doc = dict(doc, name=origin.model, version_policy={"specific": {"versions": [int(v) for v in versions]}})
    doc["max_batch_size"] = max_batch if origin.batched else 0
    for key, reshapes in (("input", origin.input_reshape), ("output", origin.output_reshape)):
        tensors = []
        for t in doc[key]:
            full = [-1] * skip + list(t["dims"])
            r = reshapes.get(t["name"])
            dims = list(r.api) if r is not None else full[lead:]
            extra = {"format": origin.formats[t["name"]]} if key == "input" and t["name"] in origin.formats else {}
            tensors.append(dict(t, dims=dims, **extra))
        doc[key] = tensors
    return doc
