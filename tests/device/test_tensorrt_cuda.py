"""The TensorRT backend's CUDA side on a real NVIDIA GPU, without TensorRT.

What TensorRT would do with our buffers is played by CUDA itself: a driver-API copy queued on the
raw stream handle (exactly what ``execute_async_v3`` receives), and a CuPy kernel, CuPy being a
CUDA *runtime* library like TensorRT, so it shows the runtime and pycuda share one context.
The backend's own instance code runs against a stand-in execution context (``_FakeContext``).

The tests skip, saying which, only where there is no GPU to run on: pycuda not installed, no CUDA
driver, or a driver that finds no device (``missing_gpu``). Past that, any exception, edged's own
included, fails the test.

    pytest --noconftest -p no:cacheprovider tests/device     # or: python tests/device/test_tensorrt_cuda.py

Set EDGED_DEVICE_REPORT=path to keep the measurements as JSON.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import re
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edged.backends.base import LoadOptions, TensorSpec
from edged.backends.tensorrt import TensorRTBackend
from edged.backends.tensorrt.cuda import CudaDevice, IOBuffers, shared_device
from edged.backends.tensorrt.fingerprint import gpu_fingerprint
from edged.backends.tensorrt.profiles import PER_CONTEXT, SHARED, ProfileSlots
from edged.backends.tensorrt.shapes import TensorPlan, io_bytes
from edged.errors import BackendError, InvalidInputError

pytestmark = pytest.mark.device
REPORT: dict[str, Any] = {}
MiB = 1 << 20


# The CUDA driver API's results that mean "no GPU here" (cuda.h).
CUDA_ERROR_STUB_LIBRARY, CUDA_ERROR_NO_DEVICE = 34, 100


def missing_gpu() -> str | None:
    """Why this machine has no NVIDIA GPU to test on, or None: pycuda not installed, no CUDA driver
    (libcuda.so.1 does not load, or is the toolkit's stub), or a driver that finds no device.
    Asked of the driver directly, so that nothing of edged's can turn into a skip."""
    if importlib.util.find_spec("pycuda") is None:
        return "pycuda is not installed (pip install 'edged[tensorrt]' on a machine with CUDA)"
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return f"no CUDA driver: libcuda.so.1 does not load ({e})"
    rc = lib.cuInit(0)
    if rc == CUDA_ERROR_STUB_LIBRARY:
        return "no CUDA driver: libcuda.so.1 is the CUDA toolkit's stub"
    if rc == CUDA_ERROR_NO_DEVICE:
        return "no NVIDIA GPU: the CUDA driver finds no device"
    count = ctypes.c_int(0)
    if rc == 0 and lib.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value == 0:
        return "no NVIDIA GPU: the CUDA driver counts no device"
    return None  # a GPU to run on; any other driver error is for the test to fail on


def skip_without_gpu() -> None:
    why = missing_gpu()
    if why is not None:
        print(f"SKIP: {why}")
        pytest.skip(why)


@pytest.fixture(scope="module")
def device() -> Iterator[CudaDevice]:
    skip_without_gpu()
    dev = shared_device(0)  # edged's own code: an exception here fails every test that uses it
    REPORT["device"] = {
        "name": dev.name,
        "cc": dev.compute_capability,
        "sms": dev.sm_count,
        "integrated": dev.integrated,
        "can_map": dev.can_map,
    }
    yield dev
    text = json.dumps(REPORT, indent=1, sort_keys=True)
    sys.stderr.write(f"\nDEVICE REPORT\n{text}\n")
    if os.environ.get("EDGED_DEVICE_REPORT"):
        Path(os.environ["EDGED_DEVICE_REPORT"]).write_text(text)


def _libcuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemcpyDtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    return lib


def current_context() -> int:
    """The calling thread's current CUDA context, from the driver itself (0: none)."""
    ctx = ctypes.c_void_p()
    assert _libcuda().cuCtxGetCurrent(ctypes.byref(ctx)) == 0
    return ctx.value or 0


def copy_engine(io: IOBuffers, nbytes: int) -> Any:
    """Stand-in for execute_async_v3: copy x to y on the raw stream handle it is given."""
    lib = _libcuda()

    def enqueue(stream: int) -> None:
        assert lib.cuMemcpyDtoDAsync_v2(io.address("y"), io.address("x"), nbytes, stream) == 0

    return enqueue


def y_shaped_like(x: np.ndarray) -> Callable[[], dict[str, tuple[int, ...]]]:
    """The output-shape callback of a copy: y has x's shape."""
    return lambda: {"y": x.shape}


def plans(shape: tuple[int, ...], dtype: str = "float32") -> list[TensorPlan]:
    return [TensorPlan("x", dtype, shape, True), TensorPlan("y", dtype, shape, False)]


def run_threads(n: int, work: Any) -> list[Any]:
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            results[i] = work(i)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def test_worker_threads_push_and_pop_the_primary_context(device: CudaDevice) -> None:
    def work(_: int) -> tuple[int, int, int]:
        before = current_context()
        with device.activate():
            inside = current_context()
        return before, inside, current_context()

    seen = run_threads(8, work)
    assert all(before == 0 and after == 0 for before, _, after in seen)
    assert {inside for _, inside, _ in seen} == {device.primary_handle}
    assert device.primary_handle != 0


def test_the_cuda_runtime_uses_the_same_primary_context(device: CudaDevice) -> None:
    cupy = pytest.importorskip("cupy", reason="cupy (a CUDA runtime library) is not installed")

    def work(_: int) -> int:
        cupy.arange(4).sum().item()  # the runtime picks a context on this fresh thread
        return current_context()

    assert run_threads(1, work) == [device.primary_handle]


@pytest.mark.parametrize("mapped", [False, True], ids=["device-buffers", "mapped-host"])
def test_instances_round_trip_on_their_own_streams(device: CudaDevice, mapped: bool) -> None:
    if mapped and not device.can_map:
        pytest.skip(f"{device.name} cannot map page-locked host memory")
    shape = (8, 3, 64, 64)

    def work(i: int) -> int:
        rng = np.random.default_rng(i)
        with device.activate():
            io = IOBuffers(device, plans(shape), mapped=mapped)
        try:
            assert io.device_bytes == (0 if mapped else io.host_bytes)
            for _ in range(25):
                n = int(rng.integers(1, shape[0] + 1))  # any batch up to the profile's max
                x = rng.standard_normal((n, *shape[1:]), dtype=np.float32)
                with device.activate():
                    out = io.run({"x": x}, copy_engine(io, x.nbytes), y_shaped_like(x))
                np.testing.assert_array_equal(out["y"], x)
            return io.stream_handle
        finally:
            with device.activate():
                io.free()

    handles = run_threads(6, work)
    assert len(set(handles)) == 6 and 0 not in handles  # six real, distinct streams


@pytest.mark.filterwarnings("ignore:ExternalStream is deprecated:DeprecationWarning")
@pytest.mark.parametrize("mapped", [False, True], ids=["device-buffers", "mapped-host"])
def test_a_runtime_kernel_computes_on_the_instance_stream(device: CudaDevice, mapped: bool) -> None:
    cupy = pytest.importorskip("cupy", reason="cupy (a CUDA runtime library) is not installed")
    affine = cupy.ElementwiseKernel("T x", "T y", "y = x * 2 + 1", "edged_affine")
    shape = (4, 1000)
    with device.activate():
        io = IOBuffers(device, plans(shape), mapped=mapped)

    def view(name: str, n: int) -> Any:
        mem = cupy.cuda.UnownedMemory(io.address(name), n * 4, io, device_id=device.ordinal)
        return cupy.ndarray((n,), cupy.float32, cupy.cuda.MemoryPointer(mem, 0))

    def enqueue(stream: int) -> None:
        with cupy.cuda.ExternalStream(stream, device.ordinal):
            affine(view("x", x.size), view("y", x.size))

    try:
        for n in (1, 3, 4):
            x = np.random.default_rng(n).standard_normal((n, 1000), dtype=np.float32)
            with device.activate():
                out = io.run({"x": x}, enqueue, y_shaped_like(x))
            np.testing.assert_allclose(out["y"], x * 2 + 1, rtol=1e-6)
    finally:
        with device.activate():
            io.free()


def test_inputs_larger_than_the_buffer_are_refused(device: CudaDevice) -> None:
    with device.activate():
        io = IOBuffers(device, plans((2, 8)))
        try:
            with pytest.raises(ValueError, match="buffer holds 16"):
                io.stage({"x": np.zeros((3, 8), np.float32)})
            with pytest.raises(TypeError):  # no silent casting into a buffer of another type
                io.stage({"x": np.zeros((2, 8), np.float64)})
        finally:
            io.free()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_free_returns_device_and_page_locked_memory(device: CudaDevice) -> None:
    shape = (64, 1024, 1024)  # 256 MiB of float32 per tensor
    free0, _ = device.mem_info()
    rss0 = _rss()
    with device.activate():
        ios = [IOBuffers(device, plans(shape)) for _ in range(2)]
    free1, _ = device.mem_info()
    rss1 = _rss()
    with device.activate():
        for io in ios:
            io.free()
            io.free()  # idempotent
    free2, _ = device.mem_info()
    rss2 = _rss()
    REPORT["memory_MiB"] = {
        "device_taken": (free0 - free1) / MiB,
        "device_not_returned": (free0 - free2) / MiB,
        "host_rss_taken": (rss1 - rss0) / MiB,
        "host_rss_not_returned": (rss2 - rss0) / MiB,
    }
    assert free0 - free1 >= 1000 * MiB  # 4 device buffers of 256 MiB
    assert free0 - free2 < 16 * MiB
    assert rss1 - rss0 >= 900 * MiB  # 4 page-locked buffers, resident
    assert rss2 - rss0 < 64 * MiB


def test_round_trip_latency(device: CudaDevice) -> None:
    """A 4.9 MB camera frame in and out, the way an instance moves it (numbers for the report)."""
    shape = (1, 3, 640, 640)
    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    results = {}
    for mapped in (False, True):
        if mapped and not device.can_map:
            continue
        with device.activate():
            io = IOBuffers(device, plans(shape), mapped=mapped)
            try:
                times = []
                for _ in range(60):
                    t0 = time.perf_counter()
                    out = io.run({"x": x}, copy_engine(io, x.nbytes), lambda: {"y": shape})
                    times.append(time.perf_counter() - t0)
                np.testing.assert_array_equal(out["y"], x)
            finally:
                io.free()
        ms = np.array(times[10:]) * 1e3
        results["mapped" if mapped else "pinned+copies"] = {
            "p50_ms": round(float(np.median(ms)), 3),
            "p99_ms": round(float(np.quantile(ms, 0.99)), 3),
        }
    REPORT["round_trip_4.9MB"] = results
    assert results


def test_fingerprint_of_this_gpu(device: CudaDevice) -> None:
    fp = gpu_fingerprint(device)
    REPORT["fingerprint"] = fp
    assert fp["gpu"] == device.name and fp["gpu"]
    assert re.fullmatch(r"\d+\.\d+", fp["compute_capability"])
    assert int(fp["sm_count"]) > 0
    assert re.fullmatch(r"\d+\.\d+", fp["cuda_driver"])
    assert "cuda_build" not in fp  # pycuda's own CUDA build: no part of what an engine is bound to
    if not device.integrated:
        assert re.fullmatch(r"\d+\.\d+(\.\d+)?", fp["driver"]), fp
        assert fp["l4t"] == ""


def test_backend_without_tensorrt_is_unavailable_not_broken(device: CudaDevice) -> None:
    ok, why = TensorRTBackend.available()
    try:
        import tensorrt

        installed = bool(tensorrt.__version__)
    except Exception:
        installed = False
    REPORT["available"] = [ok, why]
    assert ok == installed
    if not installed:
        assert "tensorrt" in why


# --- the backend's instance code against a stand-in execution context ---------------------------


class _FakeContext:
    """What the backend asks of an IExecutionContext, implemented with a device copy (an
    identity model with input x and output y)."""

    def __init__(self) -> None:
        self.addresses: dict[str, int] = {}
        self.shape: tuple[int, ...] = ()
        self.profile_calls: list[tuple[int, int]] = []

    def set_optimization_profile_async(self, index: int, stream: int) -> bool:
        self.profile_calls.append((index, stream))
        return True

    def set_tensor_address(self, name: str, address: int) -> bool:
        self.addresses[name] = address
        return True

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        self.shape = tuple(shape)
        return True

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return self.shape

    def execute_async_v3(self, stream: int) -> bool:
        nbytes = int(np.prod(self.shape)) * 4
        lib = _libcuda()
        return bool(lib.cuMemcpyDtoDAsync_v2(self.addresses["y"], self.addresses["x"], nbytes, stream) == 0)


class _FakeEngine:
    def create_execution_context(self) -> _FakeContext:
        return _FakeContext()


MAX = (16, 1024, 1024)  # 64 MiB per float32 tensor


def _fake_load(self: TensorRTBackend) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    self._device = shared_device(0)
    self._engine = _FakeEngine()  # type: ignore[assignment]
    self._plans = tuple(plans(MAX))
    self._profiles = {"x": ((1, 1024, 1024), (1, 1024, 1024), MAX)}
    self._mapped = bool(self._mapped_option)
    self._slots = ProfileSlots(SHARED, 1, True, "fake.engine")
    return (TensorSpec("x", "float32", (-1, 1024, 1024)),), (TensorSpec("y", "float32", (-1, 1024, 1024)),)


@pytest.mark.parametrize("mapped", [False, True], ids=["device-buffers", "mapped-host"])
def test_backend_instances_infer_and_unload_returns_memory(device: CudaDevice, mapped: bool) -> None:
    backend = TensorRTBackend(Path("/nonexistent.engine"), LoadOptions(instances=3, options={"mapped": mapped}))
    backend._load_impl = types.MethodType(_fake_load, backend)  # type: ignore[method-assign]
    free0, _ = device.mem_info()
    backend.load()
    instances = run_threads(3, lambda i: backend.instance())
    per_instance = io_bytes(plans(MAX), mapped)
    assert backend.footprint() == 3 * per_instance  # no engine file, no activations here

    def work(i: int) -> int:
        rng = np.random.default_rng(100 + i)
        for n in (1, 5, 16, 2):
            x = rng.standard_normal((n, 1024, 1024), dtype=np.float32)
            np.testing.assert_array_equal(instances[i].infer({"x": x})["y"], x)
        return i

    assert run_threads(3, work) == [0, 1, 2]
    with pytest.raises(InvalidInputError, match="dim 0 is 17"):
        instances[0].infer({"x": np.zeros((17, 1024, 1024), np.float32)})
    taken = free0 - device.mem_info()[0]
    backend.unload()
    not_returned = free0 - device.mem_info()[0]
    REPORT.setdefault("backend_unload_MiB", {})["mapped" if mapped else "device"] = {
        "taken": taken / MiB,
        "not_returned": not_returned / MiB,
    }
    assert taken >= (0 if mapped else 3 * 2 * 64 * MiB)
    assert not_returned < 16 * MiB
    with pytest.raises(BackendError, match="not loaded"):
        instances[1].infer({"x": np.zeros((1, 1024, 1024), np.float32)})


def test_per_context_profiles_are_set_on_each_instance_stream(device: CudaDevice) -> None:
    """TensorRT 8.5's scheme on real streams: instance i switches to profile i on its own stream
    and waits for it; a fourth instance of a three-profile engine is refused; a released profile
    is given out again."""
    backend = TensorRTBackend(Path("/nonexistent.engine"), LoadOptions(instances=3, options={"mapped": False}))
    backend._load_impl = types.MethodType(_fake_load, backend)  # type: ignore[method-assign]
    backend.load()
    backend._slots = ProfileSlots(PER_CONTEXT, 3, True, "fake.engine")
    # As the real load leaves it: the engine's first context, already on profile 0 (the fake
    # load makes none, and then every context, rightly, is told its profile).
    backend._spare = backend._engine.create_execution_context()  # type: ignore[union-attr, assignment]
    instances = run_threads(3, lambda i: backend.instance())
    calls = {inst.profile: inst._ctx.profile_calls for inst in instances}  # type: ignore[attr-defined]
    assert sorted(calls) == [0, 1, 2]
    for inst in instances:
        want = [] if inst.profile == 0 else [(inst.profile, inst.io.stream_handle)]  # type: ignore[attr-defined]
        assert inst._ctx.profile_calls == want  # type: ignore[attr-defined]
        x = np.full((2, 1024, 1024), inst.profile, np.float32)  # type: ignore[attr-defined]
        np.testing.assert_array_equal(inst.infer({"x": x})["y"], x)
    with pytest.raises(BackendError, match="has 3, all in use"):
        backend.instance()
    backend.unload()  # instances live until the model is unloaded: their profiles go with it


def test_selftest_compares_mapped_and_copied_buffers(device: CudaDevice, monkeypatch: pytest.MonkeyPatch) -> None:
    """The selftest's buffers check, its engine played by the identity stand-in."""
    from edged.tools.selftest_checks import buffers_check

    monkeypatch.setattr(TensorRTBackend, "_load_impl", _fake_load)
    rng = np.random.default_rng(11)
    feeds = [{"x": rng.standard_normal((1, 1024, 1024), dtype=np.float32)} for _ in range(4)]
    check = buffers_check(Path("/nonexistent.engine"), feeds)
    REPORT["selftest_buffers"] = check.detail
    assert check.status == "PASS", check.detail
    assert "mapped p50" in check.detail and "copied p50" in check.detail


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "--noconftest", "-p", "no:cacheprovider", "-v", "-rs"]))
