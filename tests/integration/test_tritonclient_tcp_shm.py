"""Triton's clients over TCP ask for the system shared memory status and unregister every region
before they start: both are answered (empty, success), as for CUDA shared memory, since no region
can be registered over TCP. tritonclient.http and tritonclient.grpc alike."""

from __future__ import annotations

from typing import Any

import pytest
from tritonclient.utils import InferenceServerException

from tests.integration.test_tritonclient import Served, as_dict, protocol, served

pytestmark = pytest.mark.integration
__all__ = ["protocol", "served"]  # fixtures: imported so that pytest finds them

# An empty status as each client returns it: HTTP's JSON list, gRPC's message as JSON.
EMPTY: dict[str, Any] = {"http": [], "grpc": {}}


def test_status_and_unregister_are_answered_over_tcp(served: Served, protocol: str) -> None:
    client = served.client(protocol)
    try:
        assert as_dict(protocol, client.get_system_shared_memory_status) == EMPTY[protocol]
        client.unregister_system_shared_memory()
        client.unregister_system_shared_memory("frames")
        assert as_dict(protocol, client.get_cuda_shared_memory_status) == EMPTY[protocol]
        client.unregister_cuda_shared_memory()
        with pytest.raises(InferenceServerException, match="only available to local clients"):
            client.register_system_shared_memory("in", "/edged_test_tcp_in", 64)
    finally:
        client.close()
