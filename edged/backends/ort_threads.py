"""Where an ONNX Runtime session's intra-op threads run.

Measured on a 16-core x86 host (docs/performance.md, `scripts/bench.sh placement`): a session
with a pool of one thread per core, each pinned to its core (what ONNX Runtime does by itself
when it picks the count), ran a 640x640 conv net behind edged in 1.34x the in-process time where
the same number of unpinned threads took 1.43x, four threads 2.1x and spinning off 2.1x. ONNX
Runtime's own choice ignores the process's CPU set (systemd's CPUAffinity=, taskset, a cgroup
cpuset) and every session would pin its threads to the same cores, so edged does the same
placement itself: the CPUs this process may use are split into one disjoint slice per instance,
and each instance's pool threads are pinned one per CPU of its slice. The thread that calls
``run`` (the instance's worker) is left to the scheduler, as ONNX Runtime leaves it.
"""

from __future__ import annotations

import os


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on, in order."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def cpu_slices(cpus: list[int], instances: int) -> list[list[int]]:
    """``instances`` disjoint, equal slices of ``cpus`` (at least one CPU each; when there are
    more instances than CPUs, slices are reused round-robin)."""
    instances = max(1, instances)
    per = max(1, len(cpus) // instances)
    slices = [cpus[i * per : (i + 1) * per] for i in range(min(instances, len(cpus)))]
    return [slices[i % len(slices)] for i in range(instances)]


def affinity_config(cpus: list[int]) -> str:
    """ONNX Runtime's ``session.intra_op_thread_affinities`` for a pool on ``cpus``: one entry
    per pool thread (threads - 1: the calling thread is not the pool's), 1-based processor ids,
    ';' between threads."""
    return ";".join(str(cpu + 1) for cpu in cpus[1:])
