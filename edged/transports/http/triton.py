"""Triton's extensions that its tools call, over HTTP: statistics, model configuration, logging
(their documents are edged/serving/triton_docs.py's, shared with gRPC), and the CUDA shared
memory routes (answered, not offered).

The shapes are Triton's own (server docs/protocol/extension_*.md), so ``tritonclient``'s
``get_inference_statistics``, ``get_model_config``, ``get_log_settings``/``update_log_settings``
and its example programs read them unchanged. control.py routes here; these handlers only read the
service and the ``edged`` logger, so none of them blocks the loop.
"""

from __future__ import annotations

from typing import Any

import orjson

from edged.errors import CudaSharedMemoryNotSupportedError
from edged.serving import triton_docs
from edged.serving.service import Service
from edged.serving.triton_docs import log_settings as log_settings
from edged.wire.jsondoc import load_object


def methods(parts: list[str]) -> tuple[str, ...]:
    """The methods a route of the logging or CUDA shared memory extension answers ('()' when
    ``parts`` names none of them)."""
    if parts == ["logging"]:
        return ("GET", "POST")
    if parts[0] != "cudasharedmemory":
        return ()
    rest = parts[1:]
    if rest == ["status"]:
        return ("GET",)
    if rest == ["unregister"]:
        return ("POST",)
    if len(rest) == 3 and rest[0] == "region":
        return {"status": ("GET",), "register": ("POST",), "unregister": ("POST",)}.get(rest[2], ())
    return ()


def answer(method: str, parts: list[str], body: bytes | memoryview) -> bytes:
    """The body of a 200 answer for a route ``methods`` knows, or an EdgedError."""
    if parts == ["logging"]:
        return orjson.dumps(update_log_settings(body) if method == "POST" else log_settings())
    return cuda_shared_memory(parts[1:])


def update_log_settings(body: bytes | memoryview) -> dict[str, Any]:
    """``POST /v2/logging``: triton_docs.update_log_settings of the body's JSON object."""
    return triton_docs.update_log_settings(load_object(body, "the log settings must be a JSON object"))


def statistics(service: Service, name: str | None) -> bytes:
    """``GET /v2/models[/{m}[/versions/{v}]]/stats``: every configured model, or one."""
    return orjson.dumps(triton_docs.statistics(service, name))


def model_config(service: Service, name: str) -> bytes:
    """``GET /v2/models/{m}[/versions/{v}]/config``."""
    return orjson.dumps(triton_docs.model_config(service, name))


# --- CUDA shared memory --------------------------------------------------------------------------


def cuda_shared_memory(rest: list[str]) -> bytes:
    """Triton's example clients (simple_http_cudashm_client.py and the like) first unregister
    every region, then create one on the GPU and register it, then ask for the status. The
    cleanup and the status tell the truth (no region is registered: an empty list, and
    unregistering nothing succeeds, as Triton's unregister does), so such a program stops at
    the one call that needs the feature, with the reason, instead of at a cleanup step."""
    if rest == ["status"]:
        return b"[]"
    if rest == ["unregister"] or (len(rest) == 3 and rest[2] == "unregister"):
        return b"{}"
    raise CudaSharedMemoryNotSupportedError(triton_docs.CUDA_SHM_NOT_SUPPORTED)
