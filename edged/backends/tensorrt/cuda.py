"""The CUDA side of the TensorRT backend, through pycuda, testable without TensorRT.

One ``CudaDevice`` per GPU and process holds the device's *primary* context: the context the CUDA
runtime (and so TensorRT) uses, so pointers and streams made here are valid in TensorRT's calls.
A worker thread pushes it around its work and pops it after (``activate``), so no thread is left
holding a context it does not own and every thread sees the same one.

One ``IOBuffers`` per model instance holds that instance's stream, page-locked host buffers and
device buffers, each sized once for the largest shape its profile admits. On an integrated GPU
(Jetson's unified memory) the page-locked host buffers are mapped into the GPU's address space and
handed to TensorRT directly: the device reads and writes the very pages the host filled, which
saves both copies and the device buffers.

pycuda ships no type information, so every pycuda call of edged stays in this file, behind typed
methods; the GPU tests (tests/device/) run each of them.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edged.backends.tensorrt.shapes import Shape, TensorPlan

_init_lock = threading.Lock()
_driver: Any = None


def driver() -> Any:
    """``pycuda.driver``, initialised once. Raises ImportError or pycuda's error when there is no
    pycuda or no usable driver."""
    global _driver
    with _init_lock:
        if _driver is None:
            import pycuda.driver as cuda

            cuda.init()
            _driver = cuda
        return _driver


class CudaDevice:
    """One GPU and its primary context, shared by every model in the process."""

    def __init__(self, ordinal: int = 0) -> None:
        cuda = driver()
        if cuda.Device.count() <= ordinal:
            raise RuntimeError(f"no CUDA device {ordinal} ({cuda.Device.count()} present)")
        self.ordinal = ordinal
        self._dev = cuda.Device(ordinal)
        self._ctx = self._dev.retain_primary_context()
        attr = cuda.device_attribute
        self.name = str(self._dev.name())
        major, minor = self._dev.compute_capability()
        self.compute_capability = f"{int(major)}.{int(minor)}"
        self.sm_count = int(self._dev.get_attribute(attr.MULTIPROCESSOR_COUNT))
        self.integrated = bool(self._dev.get_attribute(attr.INTEGRATED))
        self.can_map = bool(self._dev.get_attribute(attr.CAN_MAP_HOST_MEMORY))
        self.total_memory = int(self._dev.total_memory())

    @property
    def primary_handle(self) -> int:
        return int(self._ctx.handle)

    @contextlib.contextmanager
    def activate(self) -> Iterator[None]:
        """Make the primary context current on this thread for the duration of the block."""
        self._ctx.push()
        try:
            yield
        finally:
            driver().Context.pop()

    def mem_info(self) -> tuple[int, int]:
        """(free, total) device memory in bytes."""
        with self.activate():
            free, total = driver().mem_get_info()
        return int(free), int(total)


@functools.cache
def shared_device(ordinal: int = 0) -> CudaDevice:
    """The process's one ``CudaDevice`` per GPU (the primary context is retained once)."""
    return CudaDevice(ordinal)


def cuda_versions() -> tuple[str, str]:
    """(CUDA version of the driver, CUDA version pycuda was built against)."""
    cuda = driver()
    build = ".".join(str(p) for p in cuda.get_version())
    return format_cuda_version(int(cuda.get_driver_version())), build


def format_cuda_version(n: int) -> str:
    """The driver API's integer (12020) as the CUDA version it means (12.2)."""
    return f"{n // 1000}.{(n % 1000) // 10}"


@dataclass
class _Buffer:
    plan: TensorPlan
    host: np.ndarray  # page-locked, flat, max_elements long
    pinned: Any  # its pycuda HostAllocation (host.base), freed explicitly
    device: Any  # pycuda DeviceAllocation, or None when the host buffer is mapped
    address: int  # what TensorRT gets: the device allocation or the mapped host pages


class IOBuffers:
    """One instance's stream and I/O buffers. Create, use and free it with the device active
    (``CudaDevice.activate``) on the calling thread; one thread uses it at a time."""

    def __init__(self, device: CudaDevice, plans: Sequence[TensorPlan], mapped: bool | None = None) -> None:
        if mapped is None:
            mapped = device.integrated and device.can_map
        if mapped and not device.can_map:
            raise RuntimeError(f"{device.name} cannot map page-locked host memory")
        self.device = device
        self.mapped = mapped
        self._buffers: dict[str, _Buffer] = {}
        cuda = driver()
        self._stream: Any = cuda.Stream()
        try:
            for plan in plans:
                self._buffers[plan.name] = self._allocate(cuda, plan)
        except BaseException:
            self.free()
            raise

    def _allocate(self, cuda: Any, plan: TensorPlan) -> _Buffer:
        # A zero-sized tensor still gets a real (one-element) buffer: TensorRT wants an address.
        count = max(1, plan.max_elements)
        if self.mapped:
            host = cuda.pagelocked_empty(count, np.dtype(plan.dtype), mem_flags=cuda.host_alloc_flags.DEVICEMAP)
            pinned: Any = host.base
            return _Buffer(plan, host, pinned, None, int(pinned.get_device_pointer()))
        host = cuda.pagelocked_empty(count, np.dtype(plan.dtype))
        dev = cuda.mem_alloc(host.nbytes)
        return _Buffer(plan, host, host.base, dev, int(dev))

    @property
    def stream_handle(self) -> int:
        return int(self._stream.handle)

    def synchronize(self) -> None:
        """Wait for the work queued on this instance's stream."""
        self._stream.synchronize()

    def address(self, name: str) -> int:
        return self._buffers[name].address

    @property
    def host_bytes(self) -> int:
        return sum(int(b.host.nbytes) for b in self._buffers.values())

    @property
    def device_bytes(self) -> int:
        return 0 if self.mapped else self.host_bytes

    def stage(self, inputs: Mapping[str, np.ndarray]) -> None:
        """Copy the inputs into the page-locked buffers and, unless mapped, queue their copies
        to the device on this instance's stream."""
        cuda = driver()
        for name, arr in inputs.items():
            buf = self._buffers[name]
            if arr.size > buf.host.size:
                raise ValueError(f"input {name!r}: {arr.size} elements, buffer holds {buf.host.size}")
            view = buf.host[: arr.size]
            np.copyto(view.reshape(arr.shape), arr, casting="no")
            if buf.device is not None:
                cuda.memcpy_htod_async(buf.device, view, self._stream)

    def collect(self, shapes: Mapping[str, Shape]) -> dict[str, np.ndarray]:
        """Queue the outputs' copies to the host, wait for the stream, and return copies the next
        run cannot overwrite."""
        cuda = driver()
        views: dict[str, np.ndarray] = {}
        for name, shape in shapes.items():
            buf = self._buffers[name]
            count = math.prod(shape)
            if count > buf.host.size:
                raise ValueError(f"output {name!r} of shape {shape} exceeds its buffer")
            views[name] = buf.host[:count]
            if buf.device is not None:
                cuda.memcpy_dtoh_async(views[name], buf.device, self._stream)
        self._stream.synchronize()
        return {name: view.reshape(shapes[name]).copy() for name, view in views.items()}

    def run(
        self,
        inputs: Mapping[str, np.ndarray],
        enqueue: Callable[[int], None],
        output_shapes: Callable[[], Mapping[str, Shape]],
    ) -> dict[str, np.ndarray]:
        """One inference: stage the inputs, let ``enqueue`` queue the work on this instance's
        stream (TensorRT's ``execute_async_v3``), then collect the outputs."""
        self.stage(inputs)
        enqueue(self.stream_handle)
        return self.collect(output_shapes())

    def free(self) -> None:
        """Release the device and page-locked memory now (not whenever the GC runs); idempotent."""
        if self._stream is not None:
            self._stream.synchronize()
        for buf in self._buffers.values():
            if buf.device is not None:
                buf.device.free()
            buf.pinned.free()
        self._buffers.clear()
        self._stream = None
