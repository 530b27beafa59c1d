"""edged's errors as gRPC statuses: errors.py's one table (grpc_status_of), the same message as
the details, and the stable code in the ``edged-code`` trailing metadata."""

from __future__ import annotations

import logging
from typing import Any, NoReturn

import grpc

from edged.errors import EdgedError, grpc_status_of
from edged.ratelog import RateLimitedLog

log = logging.getLogger(__name__)
_bugs = RateLimitedLog(log)

CODE_KEY = "edged-code"


def status_code(e: EdgedError) -> grpc.StatusCode:
    return grpc.StatusCode[grpc_status_of(type(e))]


async def abort(context: Any, e: BaseException, rpc: str) -> NoReturn:
    """End the RPC with ``e``'s status (an unexpected exception: INTERNAL, logged)."""
    if not isinstance(e, EdgedError):
        _bugs.note(logging.ERROR, "internal", "gRPC %s failed", rpc, exc_info=e)
        e = EdgedError(f"internal error: {e}")
    context.set_trailing_metadata(((CODE_KEY, e.code),))
    await context.abort(status_code(e), e.message)
    raise AssertionError("unreachable")  # context.abort raises
