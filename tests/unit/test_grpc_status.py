"""The gRPC status of every wire code comes from errors.py's one table."""

from __future__ import annotations

import grpc

from edged.errors import (
    BadRequestError,
    BusyError,
    CudaSharedMemoryNotSupportedError,
    DeadlineExceededError,
    EdgedError,
    ModelNotFoundError,
    PayloadTooLargeError,
    StreamLimitError,
    StreamStalledError,
    UnauthorizedError,
    grpc_status_of,
    wire_codes,
)
from edged.transports.grpc.status import status_code


def test_every_wire_code_has_a_grpc_status() -> None:
    for code in wire_codes().values():
        assert code.grpc_status in grpc.StatusCode.__members__, code


def test_the_statuses_follow_the_http_status() -> None:
    assert status_code(BadRequestError("x")) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_code(ModelNotFoundError("x")) == grpc.StatusCode.NOT_FOUND
    assert status_code(UnauthorizedError("x")) == grpc.StatusCode.UNAUTHENTICATED
    assert status_code(PayloadTooLargeError("x")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_code(BusyError("x")) == grpc.StatusCode.UNAVAILABLE
    assert status_code(DeadlineExceededError("x")) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert status_code(EdgedError("x")) == grpc.StatusCode.INTERNAL
    assert status_code(StreamLimitError("x")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_code(StreamStalledError("x")) == grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_class_may_name_its_own_status() -> None:
    assert grpc_status_of(CudaSharedMemoryNotSupportedError) == "UNIMPLEMENTED"
