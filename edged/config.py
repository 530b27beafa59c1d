"""The configuration: a frozen tree loaded once from TOML and validated with key paths.

msgspec does the structural validation (types, ranges, unknown keys) because its errors carry the
exact key path and it imports in a few milliseconds, which matters for the cold start. What msgspec
cannot express (sizes such as ``"6GiB"``, cross-field rules, paths relative to the config file)
is checked here, and every error names the file and the key path: ``models.detector.precision``.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from edged.errors import ConfigError
from edged.fleet.config import FleetConfig
from edged.paths import DEFAULT_SOCKET

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 (JetPack 6)
    import tomli as tomllib

DEFAULT_CONFIG = "/etc/edged/edged.toml"
DEFAULT_CACHE = "/var/cache/edged/engines"

Backend = Literal["auto", "onnxruntime", "tensorrt", "llama"]
Precision = Literal["fp32", "fp16", "int8"]
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]


class _Table(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Every config table: immutable, and an unknown key is an error."""


class ServerConfig(_Table, frozen=True):
    socket: str = DEFAULT_SOCKET
    # Group-writable, never world-writable: membership of the socket's group is the access list.
    socket_mode: str = "0660"
    socket_group: str = ""
    max_body: str = "256MiB"
    # Request bodies being read and held (decoded from, answered), all connections together; a
    # compressed body counts as it inflates. Beyond it a request is refused with 503 body_budget.
    bodies_in_flight: str = "512MiB"
    # The JSON part of an infer request (a whole JSON body, or the header of a binary one).
    # Python objects cost 4-16 times the JSON's bytes and parsing holds the interpreter's lock,
    # so large tensors travel with the binary extension or shared memory (413 beyond).
    max_json: str = "8MiB"
    # Answers at least this large are compressed (gzip or deflate) for clients that accept it.
    compress_min_size: str = "4KiB"
    request_timeout_ms: PositiveInt = 10_000
    # Idle keep-alive connections are closed after this long (uvicorn's default is 5 s; local
    # clients such as camera pipelines keep one connection for hours).
    keepalive_s: PositiveInt = 300
    # A model whose measured inference is below this runs on the event loop: handing it to a
    # worker thread costs 40-95 us on a small board, more than the work itself.
    inline_threshold_us: NonNegInt = 60
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # Limits that keep one hostile or broken client from starving the others (see configs/edged.toml).
    max_header_size: str = "16KiB"
    max_headers: PositiveInt = 100
    read_timeout_s: PositiveFloat = 30.0
    max_connections: PositiveInt = 512
    # One peer's share of max_connections (at most all of them): a uid on the Unix socket, a
    # remote address on TCP.
    max_connections_per_peer: PositiveInt = 64
    # Beyond max_connections, slots that serve one health or metrics request each (at most two a
    # peer), so a probe is answered while every other slot is taken; 0: none.
    reserved_connections: NonNegInt = 16
    max_regions: PositiveInt = 1024
    max_regions_per_peer: PositiveInt = 256
    max_region_size: str = "256MiB"
    # All registered regions together: memory the daemon may touch on clients' behalf (a mapped
    # memfd's pages are faulted in, and charged, by the daemon).
    max_region_bytes: str = "2GiB"
    max_region_bytes_per_peer: str = "1GiB"
    # A second socket, <socket>.fd, where a client hands over a sealed memfd (SCM_RIGHTS) that the
    # daemon maps and uses in place: no copy of a frame in or out (memfd_socket.py).
    memfd_socket: bool = True
    # "" = every client may load/unload models; else only members of this group (and root).
    admin_group: str = ""
    # Extra listeners: TCP addresses ("127.0.0.1:8000", "[::1]:8000") for the same API (a
    # non-loopback one needs tcp_token_file), and a metrics-only address for Prometheus.
    tcp: list[str] = msgspec.field(default_factory=list)
    tcp_token_file: str = ""
    metrics: str = ""
    # A Triton model repository served as it is (config.pbtxt, version folders); its models join
    # [models.*]. "" = none.
    model_repository: str = ""


class CacheConfig(_Table, frozen=True):
    dir: str = DEFAULT_CACHE
    # Generations (builds for one model file, device and library version) kept per model; older
    # ones are removed once a newer one passed its gate. Entries in use are always kept.
    keep_generations: PositiveInt = 2
    quarantine_max_files: NonNegInt = 16
    quarantine_max_bytes: str = "1GiB"
    # Added to every cache key: changing it rebuilds every engine (in the background), as a
    # TensorRT, driver or L4T upgrade does.
    generation_tag: str = ""


class MemoryConfig(_Table, frozen=True):
    budget: str = "80%"
    reserve: str = "512MiB"
    probe: Literal["auto", "jtop", "nvml", "meminfo"] = "auto"


class BuildConfig(_Table, frozen=True):
    # A build does not start unless this much memory is free; on an 8 GB board an engine build
    # can take several GB and the OOM killer would pick the daemon.
    headroom: str = "1GiB"
    wait_for_memory_s: NonNegInt = 60
    timeout_s: PositiveInt = 3600
    # false: a model whose engine is missing serves at once from a fallback (ONNX Runtime fp32 on
    # the CPU) while it builds, and READY=1 waits only for what can serve now. true: build first.
    block_ready: bool = False


class LifecycleConfig(_Table, frozen=True):
    drain_timeout_s: PositiveFloat = 10.0
    watch_files: bool = True
    watch_interval_s: PositiveFloat = 2.0
    # A worker that has held one request this long without finishing stops the watchdog pings.
    stall_timeout_s: PositiveFloat = 30.0
    # The event loop's own latency is sampled every loop_probe_ms; a timer later than
    # loop_stall_ms is a stall (counted, logged once per stall).
    loop_probe_ms: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 25
    loop_stall_ms: PositiveInt = 100


class TlsConfig(_Table, frozen=True):
    ca: str = ""
    cert: str = ""
    key: str = ""
    insecure: bool = False


class HomeAssistantConfig(_Table, frozen=True):
    """Home Assistant MQTT discovery: edged announces itself and its models as sensors."""

    enabled: bool = False
    prefix: str = "homeassistant"


class MqttConfig(_Table, frozen=True):
    enabled: bool = False
    host: str = "localhost"
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 1883
    device_id: str = ""
    topic_prefix: str = "edged"
    qos: Literal[0, 1, 2] = 1
    keepalive_s: PositiveInt = 30
    username: str = ""
    password: str = ""
    tls: TlsConfig | None = None
    protocol: Literal["5", "3.1.1"] = "5"
    session_expiry_s: NonNegInt = 3600
    fleet_group: str = ""
    telemetry_interval_s: NonNegInt = 30
    reconnect_min_s: PositiveFloat = 0.5
    reconnect_max_s: PositiveFloat = 30.0
    # Requests in progress at once; MQTT 5 tells the broker (Receive Maximum) to send no more
    # unacknowledged QoS 1/2 messages than this. Beyond it a message is dropped and counted.
    max_inflight: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 64
    # Answered messages remembered per session, so that a redelivery whose acknowledgement was
    # lost is acknowledged again instead of run twice.
    dedup_window: PositiveInt = 1024
    homeassistant: HomeAssistantConfig = msgspec.field(default_factory=HomeAssistantConfig)


class ShapeProfile(_Table, frozen=True):
    """min/opt/max shapes of one input with dynamic dimensions (TensorRT optimisation profile)."""

    min: list[PositiveInt]
    opt: list[PositiveInt]
    max: list[PositiveInt]


class WarmupInput(_Table, frozen=True):
    """One input of a warm-up sample described per input (a Triton ``model_warmup`` sample):
    its whole shape, batch included, and its data."""

    shape: list[NonNegInt]
    data: Literal["random", "zero"] = "random"
    # A file of the tensor's raw bytes, row-major (BYTES: 4-byte little-endian lengths, each
    # followed by its element), in place of ``data``.
    file: str = ""


class WarmupConfig(_Table, frozen=True):
    iterations: NonNegInt = 3
    # "random" (inputs drawn at the opt shape), the path of a .npy/.npz sample file, or a table
    # of inputs by name, each with its own shape and data.
    inputs: str | dict[str, WarmupInput] = "random"


class CalibrationConfig(_Table, frozen=True):
    data: str
    method: Literal["minmax", "entropy", "percentile"] = "minmax"
    percentile: Annotated[float, msgspec.Meta(gt=90.0, le=100.0)] = 99.999
    max_samples: PositiveInt = 256
    # Images only: how to turn an image file into the model's input tensor.
    resize: list[PositiveInt] = msgspec.field(default_factory=list)
    layout: Literal["NCHW", "NHWC"] = "NCHW"
    color: Literal["RGB", "BGR"] = "RGB"
    scale: float = 1.0 / 255.0
    mean: list[float] = msgspec.field(default_factory=lambda: [0.0, 0.0, 0.0])
    std: list[float] = msgspec.field(default_factory=lambda: [1.0, 1.0, 1.0])


GateMetric = Literal["rel_l2", "cosine", "top1", "mask_iou", "det_f1"]
Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]


class GateConfig(_Table, frozen=True):
    # What "close enough to FP32" means for the task; several metrics must all pass.
    metric: GateMetric | list[GateMetric] = msgspec.field(default_factory=lambda: ["rel_l2", "cosine", "top1"])
    max_rel_l2: PositiveFloat = 0.05
    min_cosine: Annotated[float, msgspec.Meta(ge=-1.0, le=1.0)] = 0.99
    min_top1: Fraction = 0.99
    threshold: Fraction = 0.3  # mask_iou: probability maps are binarised at this value
    min_mask_iou: Fraction = 0.95
    score_threshold: Fraction = 0.25  # det_f1: detections kept from this score on
    iou_threshold: Fraction = 0.45  # det_f1: NMS overlap
    score_margin: Fraction = 0.0  # det_f1: a matching box may score this much under the threshold
    min_det_f1: Fraction = 0.95
    holdout: Annotated[float, msgspec.Meta(gt=0.0, lt=1.0)] = 0.2
    # Mixed precision when all-INT8 fails: "auto" searches for nodes to keep in float.
    search: Literal["auto", "off"] = "auto"
    max_trials: Annotated[int, msgspec.Meta(ge=1, le=64)] = 8

    @property
    def metrics(self) -> tuple[str, ...]:
        return (self.metric,) if isinstance(self.metric, str) else tuple(self.metric)


class TensorRTConfig(_Table, frozen=True):
    workspace: str = "1GiB"
    dla_core: Annotated[int, msgspec.Meta(ge=-1)] = -1
    legacy_calibrator: bool = False
    builder_optimization_level: Annotated[int, msgspec.Meta(ge=0, le=5)] = 3
    device: NonNegInt = 0  # GPU ordinal: the engine is built and loaded there
    # Strongly typed int8 (TensorRT 10+): the ops left unquantized run fp16 or fp32.
    float_parts: Literal["fp16", "fp32"] = "fp16"
    keep_fp32: list[str] = msgspec.field(default_factory=list)  # op types/node names; [] = defaults


class LlmConfig(_Table, frozen=True):
    """A language model (a GGUF file): its KV cache, concurrency and request defaults."""

    context: Annotated[int, msgspec.Meta(ge=64, le=1 << 20)] = 2048  # tokens per slot
    # Concurrent sequences, decoded together in one llama.cpp context whose KV cache holds
    # ``context`` tokens for each slot plus ``prefix_cache_tokens``; sets the model's instances.
    slots: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1
    # Prompt tokens fed per decoding step while other sequences stream: the most a new prompt
    # delays the running ones.
    prefill_chunk: Annotated[int, msgspec.Meta(ge=16, le=4096)] = 256
    # The default system message: used when a chat request sends none, kept prefilled, and its
    # state saved to the engine cache so that a restart does not prefill it again.
    system_prompt: str = ""
    # KV cells kept for prompt prefixes (the system prompt, the chat so far) that a later request
    # reuses instead of prefilling; 0 keeps none.
    prefix_cache_tokens: NonNegInt = 2048
    # How many kept prefixes have their state written to the engine cache (the system prompt
    # first, then the most reused); 0 writes none.
    saved_prefixes: NonNegInt = 4
    max_tokens: PositiveInt = 256  # a request's default
    max_tokens_limit: PositiveInt = 1024  # the most a request may ask for
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] = 0.7
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.95
    stop: list[str] = msgspec.field(default_factory=list)
    # Warm-up before READY=1: each slot prefills a chat-templated prompt of about this many
    # tokens and decodes warmup_decode_tokens, the sizes a request uses.
    warmup_prompt_tokens: PositiveInt = 256
    warmup_decode_tokens: PositiveInt = 16


class ModelConfig(_Table, frozen=True):
    path: str
    backend: Backend = "auto"
    precision: Precision = "fp32"
    priority: Annotated[int, msgspec.Meta(ge=0, le=100)] = 50
    preload: Literal["boot", "lazy"] = "boot"
    instances: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1
    max_batch: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1
    max_queue_delay_us: NonNegInt = 0
    # Batch sizes (rows) a batch is made of when the queue allows: Triton's preferred_batch_size.
    preferred_batch: list[PositiveInt] = msgspec.field(default_factory=list)
    queue_depth: PositiveInt = 64
    timeout_ms: NonNegInt = 0  # 0: the server's request_timeout_ms
    threads: NonNegInt = 0  # intra-op threads per instance; 0 = cores / instances
    profiles: dict[str, ShapeProfile] = msgspec.field(default_factory=dict)
    warmup: WarmupConfig = msgspec.field(default_factory=WarmupConfig)
    calibration: CalibrationConfig | None = None
    gate: GateConfig = msgspec.field(default_factory=GateConfig)
    tensorrt: TensorRTConfig = msgspec.field(default_factory=TensorRTConfig)
    llm: LlmConfig | None = None  # a GGUF model without this table gets LlmConfig()'s defaults


class Reshape(_Table, frozen=True):
    """A tensor that clients see in another shape than the model file has (Triton's reshape);
    both without the batch dimension of a batched model, -1 for a variable size."""

    api: list[int]
    model: list[int]


class RepositoryModel(_Table, frozen=True):
    """A model served from a Triton model repository: the name and version clients ask for and
    what edged made of its folder. Set by edged.repository, never read from a file."""

    model: str  # the name clients use
    version: str  # its version folder
    folder: str  # <repository>/<model>
    batched: bool = False  # max_batch_size > 0: every tensor's first dimension is the batch
    input_reshape: dict[str, Reshape] = msgspec.field(default_factory=dict)
    output_reshape: dict[str, Reshape] = msgspec.field(default_factory=dict)
    formats: dict[str, str] = msgspec.field(default_factory=dict)  # input → "FORMAT_NCHW", for clients
    # What edged serves otherwise than config.pbtxt asks, and why (a model.plan not served as is).
    note: str = ""


# Keys of Config that the loaders set and a file may not.
DERIVED_KEYS = ("source", "repository", "repository_arg")


class Config(_Table, frozen=True):
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


# --- sizes ---------------------------------------------------------------------------------------

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """``"6GiB"`` → bytes. Raises ValueError with a readable message."""
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise ValueError(f"expected a size such as '512MiB' or '6GiB', got {text!r}")
    return int(float(m.group(1)) * _UNITS[unit])


def parse_budget(text: str, total: int) -> int:
    """A budget is a share of total memory (``"80%"``) or an absolute size."""
    stripped = text.strip()
    if stripped.endswith("%"):
        try:
            pct = float(stripped[:-1])
        except ValueError:
            raise ValueError(f"expected a percentage such as '80%', got {text!r}") from None
        if not 0 < pct <= 100:
            raise ValueError(f"a percentage must be in (0, 100], got {text!r}")
        return int(total * pct / 100)
    return parse_size(stripped)


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


# --- loading --------------------------------------------------------------------------------------

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


def _check_sizes(cfg: Config, src: str) -> None:
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


def _check_model(name: str, model: ModelConfig, src: str) -> None:
    where = f"{src}: models.{name}"
    if not NAME_RE.match(name):
        raise ConfigError(f"{where}: a model name is 1-64 of [A-Za-z0-9_.-], starting alnum")
    if model.precision == "int8" and model.calibration is None:
        raise ConfigError(
            f"{where}.precision: int8 needs calibration data; add a table "
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
    _check_sizes(cfg, source)
    for name, model in cfg.models.items():
        _check_model(name, model, source)
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
    _check_model(name, model, source)
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
