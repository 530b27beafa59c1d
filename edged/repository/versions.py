"""A model's version folders and which of them its version policy serves.

Triton's rules: a version is a sub-folder named by a positive decimal number without a leading
zero (others, and "0", are not versions); ``version_policy`` is ``latest { num_versions: N }``
(N defaults to 1), ``all {}`` or ``specific { versions: [...] }``, and without one, the latest
version alone is served.
"""

from __future__ import annotations

import os
from pathlib import Path

from edged.errors import ConfigError
from edged.wire.proto import model_config_pb2


def is_version(name: str) -> bool:
    return name.isdecimal() and name.isascii() and not name.startswith("0")


def version_folders(folder: Path) -> list[int]:
    """The versions present in a model's folder, in ascending order."""
    try:
        entries = list(os.scandir(folder))
    except OSError as e:
        raise ConfigError(f"{folder}: cannot list the model's folder: {e.strerror}") from None
    return sorted(int(e.name) for e in entries if is_version(e.name) and e.is_dir())


def served(config: model_config_pb2.ModelConfig, present: list[int], where: str) -> list[int]:
    """The versions ``config``'s policy serves among ``present``, ascending; an error when it
    serves none or names one that is not there."""
    if not present:
        raise ConfigError(f"{where}: no version folder (1/, 2/, ...) holds the model")
    policy = config.version_policy
    choice = policy.WhichOneof("policy_choice") if config.HasField("version_policy") else None
    if choice == "all":
        return present
    if choice == "specific":
        wanted = sorted(set(policy.specific.versions))
        if not wanted:
            raise ConfigError(f"{where}: version_policy.specific.versions: lists no version")
        missing = [v for v in wanted if v not in present]
        if missing:
            raise ConfigError(
                f"{where}: version_policy.specific.versions: version {missing[0]} has no folder "
                f"(the folders hold {', '.join(map(str, present))})"
            )
        return wanted
    count = policy.latest.num_versions if choice == "latest" else 0
    return present[-max(count, 1) :]
