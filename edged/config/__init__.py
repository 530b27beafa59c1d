"""The configuration: a frozen tree loaded once from TOML and validated with key paths.

msgspec does the structural validation (types, ranges, unknown keys) because its errors carry the
exact key path and it imports in a few milliseconds, which matters for the cold start. What msgspec
cannot express (sizes such as ``"6GiB"``, cross-field rules, paths relative to the config file)
is checked here, and every error names the file and the key path: ``models.detector.precision``.

The tables live in ``server`` (daemon-wide) and ``models`` (per model) on ``base``'s ``Table``;
``tree`` is the whole ``Config``; ``checks`` holds the rules msgspec cannot express; ``load``
reads TOML. Everything is imported from ``edged.config``.
"""

from __future__ import annotations

from edged.config.base import (
    DEFAULT_CACHE,
    DEFAULT_CONFIG,
    NAME_RE,
    Backend,
    NonNegInt,
    PositiveFloat,
    PositiveInt,
    Precision,
    Table,
)
from edged.config.checks import check_model, check_sizes
from edged.config.load import (
    convert_model,
    default_config_path,
    finish_model,
    from_mapping,
    load,
    max_body_bytes,
    read_toml,
    tomllib,
)
from edged.config.models import (
    CalibrationConfig,
    Fraction,
    GateConfig,
    GateMetric,
    LlmConfig,
    ModelConfig,
    RepositoryModel,
    Reshape,
    ShapeProfile,
    TensorRTConfig,
    WarmupConfig,
    WarmupInput,
)
from edged.config.server import (
    BuildConfig,
    CacheConfig,
    HomeAssistantConfig,
    LifecycleConfig,
    MemoryConfig,
    MqttConfig,
    ServerConfig,
    TlsConfig,
)
from edged.config.sizes import format_size, parse_budget, parse_size
from edged.config.tree import DERIVED_KEYS, Config
from edged.errors import ConfigError

__all__ = [
    "DEFAULT_CACHE",
    "DEFAULT_CONFIG",
    "DERIVED_KEYS",
    "NAME_RE",
    "Backend",
    "BuildConfig",
    "CacheConfig",
    "CalibrationConfig",
    "Config",
    "ConfigError",
    "Fraction",
    "GateConfig",
    "GateMetric",
    "HomeAssistantConfig",
    "LifecycleConfig",
    "LlmConfig",
    "MemoryConfig",
    "ModelConfig",
    "MqttConfig",
    "NonNegInt",
    "PositiveFloat",
    "PositiveInt",
    "Precision",
    "RepositoryModel",
    "Reshape",
    "ServerConfig",
    "ShapeProfile",
    "Table",
    "TensorRTConfig",
    "TlsConfig",
    "WarmupConfig",
    "WarmupInput",
    "check_model",
    "check_sizes",
    "convert_model",
    "default_config_path",
    "finish_model",
    "format_size",
    "from_mapping",
    "load",
    "max_body_bytes",
    "parse_budget",
    "parse_size",
    "read_toml",
    "tomllib",
]
