"""Triton's HTTP client over TCP asks for the system shared memory status and unregisters every
region before it starts: both are answered (an empty list, success), as for CUDA shared memory,
since no region can be registered over TCP."""

from __future__ import annotations

import pytest
import tritonclient.http as tritonhttp
from tritonclient.utils import InferenceServerException

from tests.helpers import DaemonProcess
from tests.integration.test_tritonclient import served

pytestmark = pytest.mark.integration
__all__ = ["served"]  # a fixture: imported so that pytest finds it


def test_status_and_unregister_are_answered_over_tcp(served: tuple[DaemonProcess, int]) -> None:
    _, port = served
    client = tritonhttp.InferenceServerClient(url=f"127.0.0.1:{port}")
    try:
        assert client.get_system_shared_memory_status() == []
        client.unregister_system_shared_memory()
        client.unregister_system_shared_memory("frames")
        assert client.get_cuda_shared_memory_status() == []
        client.unregister_cuda_shared_memory()
        with pytest.raises(InferenceServerException, match="only available to local clients"):
            client.register_system_shared_memory("in", "/edged_test_tcp_in", 64)
    finally:
        client.close()
