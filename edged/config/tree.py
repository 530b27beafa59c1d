"""The whole configuration tree, one frozen value."""

from __future__ import annotations

import msgspec

from edged.config.base import Table
from edged.config.models import ModelConfig, RepositoryModel
from edged.config.server import BuildConfig, CacheConfig, LifecycleConfig, MemoryConfig, MqttConfig, ServerConfig
from edged.fleet.config import FleetConfig

# Keys of Config that the loaders set and a file may not.
DERIVED_KEYS = ("source", "repository", "repository_arg")


class Config(Table, frozen=True):
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    memory: MemoryConfig = msgspec.field(default_factory=MemoryConfig)
    build: BuildConfig = msgspec.field(default_factory=BuildConfig)
    lifecycle: LifecycleConfig = msgspec.field(default_factory=LifecycleConfig)
    mqtt: MqttConfig = msgspec.field(default_factory=MqttConfig)
    models: dict[str, ModelConfig] = msgspec.field(default_factory=dict)
    fleet: FleetConfig = msgspec.field(default_factory=FleetConfig)
    # Where the config came from; set by load(), never read from the file.
    source: str = ""
    # The models of [server] model_repository by the name edged serves them under (a served
    # version other than the latest as NAME@VERSION); set by edged.repository.
    repository: dict[str, RepositoryModel] = msgspec.field(default_factory=dict)
    # `edged serve --model-repository`, kept so that a reload reads the same repository.
    repository_arg: str = ""
