"""Probe: what reading a shared memory frame through the kernel costs against the old mapping.

edged no longer touches client pages through a mapping (a client that shrinks its object would
turn that access into SIGBUS and kill the daemon): inputs are copied with preadv into a daemon
buffer, outputs written with pwrite after an fstat size check. This measures both, on a
1x3x640x640 float32 frame (4.9 MB), against:

- ``mmap view``: the old zero-copy path (a view of the mapping handed to the model; the model's
  own read of the pages is then the only copy),
- ``mmap memcpy``: copying out of the mapping with numpy (fast, but it faults like the view).

Each variant runs in alternating blocks (the machine is shared); the medians and p90 of the
per-block means are printed. ``+ read`` adds one pass over the data (what a model does anyway),
so the view's deferred cost is counted.

    .venv/bin/python -m bench.shm_copy [--blocks 15] [--per-block 40]
"""

from __future__ import annotations

import argparse
import mmap
import os
import secrets
import statistics
import time
from collections.abc import Callable

import numpy as np

from edged.transports.shm.copies import _read_all, _write_all
from edged.transports.shm.regions import Region

SHAPE = (1, 3, 640, 640)


def variants(fd: int, view: memoryview, n: int) -> dict[str, Callable[[], object]]:
    region = Region("bench", "bench", 0, n, fd, os.getuid(), os.getpid())
    out = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)

    def view_in() -> np.ndarray:
        return np.frombuffer(view[:n], np.float32)

    def memcpy_in() -> np.ndarray:
        buf = np.empty(n, np.uint8)
        np.copyto(buf, np.frombuffer(view[:n], np.uint8))
        return buf.view(np.float32)

    def pread_in() -> np.ndarray:
        buf = np.empty(n, np.uint8)
        _read_all(region, 0, buf)
        return buf.view(np.float32)

    def view_out() -> None:
        np.frombuffer(view[:n], np.uint8)[:] = out.reshape(-1).view(np.uint8)

    def pwrite_out() -> None:
        buf = np.empty(n, np.uint8)
        buf[:] = out.reshape(-1).view(np.uint8)  # what encode_infer does into the daemon buffer
        _write_all(region, 0, buf)

    return {
        "input: mmap view (old)": view_in,
        "input: mmap view + read": lambda: float(view_in().sum()),
        "input: mmap memcpy (unsafe)": memcpy_in,
        "input: preadv (edged)": pread_in,
        "input: preadv + read": lambda: float(pread_in().sum()),
        "output: into mmap (old)": view_out,
        "output: fstat + pwrite (edged)": pwrite_out,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=15)
    ap.add_argument("--per-block", type=int, default=40)
    args = ap.parse_args(argv)
    n = int(np.prod(SHAPE)) * 4
    path = f"/dev/shm/edged-probe-{secrets.token_hex(4)}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, n)
        mapping = mmap.mmap(fd, n)
        view = memoryview(mapping)
        np.frombuffer(mapping, np.uint8)[:] = 1
        fns = variants(fd, view, n)
        blocks: dict[str, list[float]] = {k: [] for k in fns}
        for fn in fns.values():
            for _ in range(5):
                fn()  # warm
        for _ in range(args.blocks):
            for name, fn in fns.items():
                started = time.perf_counter()
                for _ in range(args.per_block):
                    fn()
                blocks[name].append((time.perf_counter() - started) / args.per_block * 1e6)
        print(f"frame {SHAPE} float32, {n} bytes; {args.blocks} blocks x {args.per_block} calls; per call:")
        for name, times in blocks.items():
            times.sort()
            p90 = times[min(len(times) - 1, int(len(times) * 0.9))]
            print(
                f"  {name:32s} median {statistics.median(times):8.1f} us   p90 {p90:8.1f} us   best {times[0]:8.1f} us"
            )
        view.release()
        mapping.close()
    finally:
        os.close(fd)
        os.unlink(path)


if __name__ == "__main__":
    main()
