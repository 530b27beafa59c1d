"""The TensorRT backend (TensorRT 8.5 through 11, on Jetson and NVIDIA GPUs).

This package is the only part of edged that imports ``tensorrt`` or ``pycuda``, and it imports
them only when used: the daemon starts without them, and ``available()`` says why they are not
usable instead of failing. Its parts:

- ``versions``: what differs between TensorRT versions (pure; the build plan);
- ``shapes``: profiles, dtypes and buffer sizes (pure);
- ``profiles``: which optimization profile each execution context uses, per version (pure);
- ``fp16``: a Q/DQ model's float parts in FP16 for strongly typed builds (an ONNX graph pass);
- ``cuda``: the primary context, streams and page-locked/device buffers (pycuda, no TensorRT);
- ``fingerprint``: what an engine is bound to, for the cache key;
- ``trtlog``: TensorRT's logger bridged into ``logging``;
- ``build`` and ``calibrator``: engine building (the build child process); the legacy
  calibrator reads its samples through ``edged.quantize.calibrate``, the one loader;
- ``timing``: the device's timing cache, shared by every build and search trial;
- ``backend``: loading, instances, inference.
"""

from edged.backends.tensorrt.backend import TensorRTBackend

__all__ = ["TensorRTBackend"]
