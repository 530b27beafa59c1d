"""What msgspec cannot express: sizes, cross-field rules, each naming the file and the key."""

from __future__ import annotations

from edged.config.base import NAME_RE
from edged.config.models import LlmConfig, ModelConfig
from edged.config.sizes import parse_budget, parse_size
from edged.config.tree import Config
from edged.errors import ConfigError


def check_sizes(cfg: Config, src: str) -> None:
    sizes = {
        "server.max_body": cfg.server.max_body,
        "server.bodies_in_flight": cfg.server.bodies_in_flight,
        "server.max_header_size": cfg.server.max_header_size,
        "server.max_region_size": cfg.server.max_region_size,
        "server.max_region_bytes": cfg.server.max_region_bytes,
        "server.max_region_bytes_per_peer": cfg.server.max_region_bytes_per_peer,
        "server.max_json": cfg.server.max_json,
        "server.compress_min_size": cfg.server.compress_min_size,
        "memory.reserve": cfg.memory.reserve,
        "build.headroom": cfg.build.headroom,
        "cache.quarantine_max_bytes": cfg.cache.quarantine_max_bytes,
        "fleet.max_bundle_size": cfg.fleet.max_bundle_size,
    }
    for name, model in cfg.models.items():
        sizes[f"models.{name}.tensorrt.workspace"] = model.tensorrt.workspace
    for key, value in sizes.items():
        try:
            parse_size(value)
        except ValueError as e:
            raise ConfigError(f"{src}: {key}: {e}") from None
    try:
        parse_budget(cfg.memory.budget, 1 << 40)
    except ValueError as e:
        raise ConfigError(f"{src}: memory.budget: {e}") from None
    try:
        mode = int(cfg.server.socket_mode, 8)
    except ValueError:
        raise ConfigError(f"{src}: server.socket_mode: expected octal such as '0660'") from None
    if mode & 0o002:
        raise ConfigError(f"{src}: server.socket_mode: the socket must not be world-writable")
    if parse_size(cfg.server.bodies_in_flight) < parse_size(cfg.server.max_body):
        raise ConfigError(
            f"{src}: server.bodies_in_flight: smaller than server.max_body, no body of that size could be read"
        )


def check_model(name: str, model: ModelConfig, src: str) -> None:
    where = f"{src}: models.{name}"
    if not NAME_RE.match(name):
        raise ConfigError(f"{where}: a model name is 1-64 of [A-Za-z0-9_.-], starting alnum")
    if model.precision in ("int8", "auto") and model.calibration is None:
        # auto's candidates include int8, and every reduced candidate is judged on held-out samples.
        raise ConfigError(
            f"{where}.precision: {model.precision} needs calibration data; add a table "
            f'[models.{name}.calibration] with data = "folder of .npy/.npz samples or images"'
        )
    for inp, prof in model.profiles.items():
        if not (len(prof.min) == len(prof.opt) == len(prof.max)):
            raise ConfigError(f"{where}.profiles.{inp}: min, opt and max must have equal rank")
        if any(a > b or b > c for a, b, c in zip(prof.min, prof.opt, prof.max)):
            raise ConfigError(f"{where}.profiles.{inp}: needs min <= opt <= max in every dim")
    if model.tensorrt.dla_core >= 0:
        for inp, prof in model.profiles.items():
            if not prof.min == prof.opt == prof.max:
                raise ConfigError(
                    f"{where}.profiles.{inp}: DLA (tensorrt.dla_core = {model.tensorrt.dla_core}) runs "
                    f"static shapes only; set min = opt = max (e.g. all {prof.opt}) or dla_core = -1"
                )
    if model.max_batch > 1 and model.max_batch > model.queue_depth:
        raise ConfigError(f"{where}.max_batch: larger than queue_depth ({model.queue_depth})")
    too_large = [n for n in model.preferred_batch if n > model.max_batch]
    if too_large:
        raise ConfigError(f"{where}.preferred_batch: {too_large[0]} is larger than max_batch ({model.max_batch})")
    if isinstance(model.warmup.inputs, dict):
        for inp, sample in model.warmup.inputs.items():
            if sample.file and sample.data != "random":
                raise ConfigError(f"{where}.warmup.inputs.{inp}: give either data or file, not both")
    if model.llm is not None:
        _check_llm(where, model, model.llm)


def _check_llm(where: str, model: ModelConfig, llm: LlmConfig) -> None:
    if model.instances not in (1, llm.slots):
        raise ConfigError(f"{where}.instances: a language model's instances are its llm.slots ({llm.slots})")
    if llm.max_tokens > llm.max_tokens_limit:
        raise ConfigError(f"{where}.llm.max_tokens: larger than max_tokens_limit ({llm.max_tokens_limit})")
    if llm.max_tokens_limit >= llm.context:
        raise ConfigError(f"{where}.llm.max_tokens_limit: must leave room for the prompt in context ({llm.context})")
    if llm.warmup_prompt_tokens + llm.warmup_decode_tokens >= llm.context:
        raise ConfigError(f"{where}.llm.warmup_prompt_tokens: the warm-up does not fit in context ({llm.context})")
    if model.queue_depth < llm.slots:
        raise ConfigError(f"{where}.queue_depth: smaller than llm.slots ({llm.slots})")
    if len(llm.system_prompt) > 16 * llm.context:
        raise ConfigError(f"{where}.llm.system_prompt: longer than the context ({llm.context} tokens) can hold")
