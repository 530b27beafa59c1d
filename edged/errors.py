"""The one exception tree of edged, with stable wire codes.

Every error a client can see carries a machine-readable ``code`` that never changes between
releases and the HTTP status the Open Inference Protocol prescribes. MQTT replies reuse the same
code and message, so both transports report the same failure the same way. This module imports
nothing from edged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


class EdgedError(Exception):
    """An unexpected failure inside edged (this class is the base of every error it raises on purpose)."""

    code: ClassVar[str] = "internal"
    http_status: ClassVar[int] = 500
    # The gRPC status name (grpc.StatusCode's member) where the HTTP status does not decide it
    # (GRPC_BY_HTTP below); '' for the usual one.
    grpc_status: ClassVar[str] = ""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_dict(self) -> dict[str, str]:
        return {"error": self.message, "code": self.code}


# --- configuration and start-up -------------------------------------------------------------


class ConfigError(EdgedError):
    """A config file that cannot be used; the message names the file and the key path."""

    code = "config_invalid"
    http_status = 400


class SocketInUseError(EdgedError):
    """Another edged already serves on the socket path, or the path is not a usable socket."""

    code = "socket_in_use"


# --- request errors (the client can fix them) ------------------------------------------------


class BadRequestError(EdgedError):
    """Malformed body: not JSON, wrong JSON shape, inconsistent binary sizes."""

    code = "bad_request"
    http_status = 400


class InvalidInputError(BadRequestError):
    """A well-formed request whose tensors do not match the model (name, dtype, shape)."""

    code = "invalid_input"


class PayloadTooLargeError(BadRequestError):
    """The body (or its JSON part) exceeds its configured limit."""

    code = "payload_too_large"
    http_status = 413


class NotFoundError(EdgedError):
    """No such route or resource."""

    code = "not_found"
    http_status = 404


class ModelNotFoundError(NotFoundError):
    """No model of that name is configured."""

    code = "model_not_found"

    @classmethod
    def named(cls, name: str) -> ModelNotFoundError:
        """Triton's own words: its example clients and tests match the message's start."""
        return cls(f"Request for unknown model: '{name}' is not found")


class ModelVersionNotFoundError(NotFoundError):
    """A version the model does not serve ("1" for a model of the config, a repository model's served versions)."""

    code = "model_version_not_found"


class UnsupportedEncodingError(BadRequestError):
    """A request body in a Content-Encoding edged does not read (gzip, deflate and identity are read)."""

    code = "unsupported_encoding"
    http_status = 415


class ClientGoneError(BadRequestError):
    """HTTP only: the client closed the connection before its request body arrived (nobody reads the answer)."""

    code = "client_disconnected"


class UnauthorizedError(EdgedError):
    """HTTP only: a TCP listener with ``server.tcp_token_file`` and no or a wrong
    ``Authorization: Bearer`` token."""

    code = "unauthorized"
    http_status = 401


class MethodNotAllowedError(EdgedError):
    """HTTP only: a known path with the wrong method (the ``Allow`` header lists the right ones)."""

    code = "method_not_allowed"
    http_status = 405

    def __init__(self, message: str, allow: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.allow = allow


class SharedMemoryError(BadRequestError):
    """A shared memory region that does not exist, is too small, or cannot be mapped."""

    code = "shm_invalid"


class SharedMemoryNotFoundError(SharedMemoryError):
    """No region of that name is registered by this client, or its key does not exist."""

    code = "shm_region_not_found"


class SharedMemoryTruncatedError(SharedMemoryError):
    """The region's object was shrunk after registration: an error for that request, not a signal."""

    code = "shm_region_truncated"


class SharedMemoryForbiddenError(SharedMemoryError):
    """The shared memory object belongs to another user than the client's."""

    code = "shm_forbidden"
    http_status = 403


class SharedMemoryLimitError(SharedMemoryError):
    """Too many regions registered, in total or by this user."""

    code = "shm_limit"
    http_status = 429


class SharedMemoryTooLargeError(SharedMemoryError):
    """A region larger than server.max_region_size."""

    code = "shm_too_large"
    http_status = 413


class ForbiddenError(EdgedError):
    """The client's user may not do this (e.g. load/unload without server.admin_group)."""

    code = "forbidden"
    http_status = 403


class CudaSharedMemoryNotSupportedError(EdgedError):
    """CUDA shared memory is not offered: the backends read host memory; use system shared memory."""

    code = "cuda_shm_not_supported"
    http_status = 400
    grpc_status = "UNIMPLEMENTED"


class StreamLimitError(EdgedError):
    """gRPC only: a ModelStreamInfer stream past server.grpc_stream_requests requests (open a new
    one), or a call past server.grpc_max_streams calls at once (retry)."""

    code = "stream_limit"
    http_status = 429


class StreamStalledError(EdgedError):
    """gRPC only: the peer took no response of its stream within server.grpc_write_timeout_s."""

    code = "stream_stalled"
    http_status = 504


# --- availability (retry later) ---------------------------------------------------------------


class UnavailableError(EdgedError):
    """edged cannot serve this now; try again later."""

    code = "unavailable"
    http_status = 503


class ModelNotReadyError(UnavailableError):
    """The model is known but deferred, failed, loading or unloaded; the message says why."""

    code = "model_not_ready"


class BusyError(UnavailableError):
    """The model's queue is full: answered at once rather than piling requests up."""

    code = "busy"


class BodyBudgetError(UnavailableError):
    """Request bodies being read and held, all together, would exceed ``server.bodies_in_flight``:
    retry later (a compressed body is counted as it inflates)."""

    code = "body_budget"


class ShuttingDownError(UnavailableError):
    """edged is stopping and takes no new requests."""

    code = "shutting_down"


class DeadlineExceededError(EdgedError):
    """The request's deadline passed before (or while) it ran."""

    code = "deadline_exceeded"
    http_status = 504


# --- server-side failures ------------------------------------------------------------------------


class BackendError(EdgedError):
    """The backend failed to run a request; the daemon keeps serving."""

    code = "backend_error"


class BackendUnavailableError(EdgedError):
    """The backend cannot be used on this machine (missing library, no GPU)."""

    code = "backend_unavailable"


class BuildError(EdgedError):
    """An engine build failed (calibration, quantization, the backend's builder, the accuracy gate)."""

    code = "build_failed"


class CacheError(EdgedError):
    """A cache entry is unusable (checksum, manifest or load failure); it is moved aside and rebuilt."""

    code = "cache_error"


class RepositoryPollError(EdgedError):
    """A load request's files could not be placed as the model's folder (a path no file system
    takes). Triton answers this as a failure to poll its repository, INTERNAL/500, and its client
    examples check for exactly that, so edged answers the same."""

    code = "repository_poll"


class BudgetError(EdgedError):
    """A model does not fit in the memory budget."""

    code = "over_budget"
    http_status = 507


# --- the wire table ------------------------------------------------------------------------------
# One table for every transport: a fault raises one of the classes above wherever it is found,
# and each transport reports the class's code (HTTP: in the JSON body, with the class's status;
# MQTT: in the JSON reply and the 'code' user property). The same fault therefore carries the
# same code on the socket and over MQTT; the order of checks (model first, then the body) lives
# in the service, which both transports call.


# gRPC's status for each HTTP status edged answers, as Triton's gRPC endpoint reports the same
# faults: a request the client can fix is INVALID_ARGUMENT, a body over a limit is
# RESOURCE_EXHAUSTED (what grpcio itself answers for a message over its maximum).
GRPC_BY_HTTP = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    405: "UNIMPLEMENTED",
    413: "RESOURCE_EXHAUSTED",
    415: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
    507: "RESOURCE_EXHAUSTED",
}


def grpc_status_of(cls: type[EdgedError]) -> str:
    """The gRPC status name of an error class (a member of grpc.StatusCode)."""
    return cls.grpc_status or GRPC_BY_HTTP.get(cls.http_status, "UNKNOWN")


@dataclass(frozen=True)
class WireCode:
    code: str
    http_status: int
    meaning: str  # the first line of the class's docstring, or its name
    cls: type[EdgedError]

    @property
    def grpc_status(self) -> str:
        return grpc_status_of(self.cls)


def wire_codes() -> dict[str, WireCode]:
    """Every stable code, from the exception tree as loaded (a transport may add its own, such
    as HTTP's 405), most general class first when two share a code."""
    table: dict[str, WireCode] = {}
    stack: list[type[EdgedError]] = [EdgedError]
    while stack:
        cls = stack.pop(0)
        meaning = (cls.__doc__ or cls.__name__).strip().splitlines()[0]
        table.setdefault(cls.code, WireCode(cls.code, cls.http_status, meaning, cls))
        stack.extend(cls.__subclasses__())
    return table
