"""The daemon-wide tables: [server], [cache], [memory], [build], [lifecycle], [mqtt]."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from edged.config.base import DEFAULT_CACHE, NonNegInt, PositiveFloat, PositiveInt, Table
from edged.paths import DEFAULT_SOCKET


class ServerConfig(Table, frozen=True):
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
    # The name server metadata reports. Triton's example clients and some of its users' scripts
    # check for "triton": set it so for them (docs/triton-migration.md).
    metadata_name: Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")] = "edged"
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
    # KServe v2 gRPC (Triton's GRPCInferenceService): on a Unix socket beside the HTTP one (""
    # = the HTTP socket's path with ".grpc" appended, same mode and group; "none" = no gRPC
    # socket) and on TCP addresses (the bearer token of tcp_token_file as for HTTP).
    grpc_socket: str = ""
    grpc_tcp: list[str] = msgspec.field(default_factory=list)
    # RPCs in progress at once, over every gRPC connection (beyond: RESOURCE_EXHAUSTED); a unary
    # call counts until its answer is made, a stream until it ends.
    grpc_max_streams: PositiveInt = 256
    # Requests one ModelStreamInfer stream may carry; the client opens a new stream after.
    grpc_stream_requests: PositiveInt = 100_000
    # A stream's response that the peer does not take within this long cancels the stream; a
    # unary answer not delivered within it closes its connection (the Unix socket).
    grpc_write_timeout_s: PositiveFloat = 10.0
    # A Triton model repository served as it is (config.pbtxt, version folders); its models join
    # [models.*]. "" = none.
    model_repository: str = ""
    # Models a load request may bring its own files for (tritonclient's load_model(files=...)),
    # each at most a request body; they are kept under cache.dir until replaced or the next
    # start. 0 = a load's files are refused (its config alone is taken).
    model_uploads: NonNegInt = 0


class CacheConfig(Table, frozen=True):
    dir: str = DEFAULT_CACHE
    # Generations (builds for one model file, device and library version) kept per model; older
    # ones are removed once a newer one passed its gate. Entries in use are always kept.
    keep_generations: PositiveInt = 2
    quarantine_max_files: NonNegInt = 16
    quarantine_max_bytes: str = "1GiB"
    # Added to every cache key: changing it rebuilds every engine (in the background), as a
    # TensorRT, driver or L4T upgrade does.
    generation_tag: str = ""


class MemoryConfig(Table, frozen=True):
    budget: str = "80%"
    reserve: str = "512MiB"
    probe: Literal["auto", "jtop", "nvml", "meminfo"] = "auto"


class BuildConfig(Table, frozen=True):
    # A build does not start unless this much memory is free; on an 8 GB board an engine build
    # can take several GB and the OOM killer would pick the daemon.
    headroom: str = "1GiB"
    wait_for_memory_s: NonNegInt = 60
    timeout_s: PositiveInt = 3600
    # false: a model whose engine is missing serves at once from a fallback (ONNX Runtime fp32 on
    # the CPU) while it builds, and READY=1 waits only for what can serve now. true: build first.
    block_ready: bool = False


class LifecycleConfig(Table, frozen=True):
    drain_timeout_s: PositiveFloat = 10.0
    watch_files: bool = True
    watch_interval_s: PositiveFloat = 2.0
    # A worker that has held one request this long without finishing stops the watchdog pings.
    stall_timeout_s: PositiveFloat = 30.0
    # The event loop's own latency is sampled every loop_probe_ms; a timer later than
    # loop_stall_ms is a stall (counted, logged once per stall).
    loop_probe_ms: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 25
    loop_stall_ms: PositiveInt = 100


class TlsConfig(Table, frozen=True):
    ca: str = ""
    cert: str = ""
    key: str = ""
    insecure: bool = False


class HomeAssistantConfig(Table, frozen=True):
    """Home Assistant MQTT discovery: edged announces itself and its models as sensors."""

    enabled: bool = False
    prefix: str = "homeassistant"


class MqttConfig(Table, frozen=True):
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
