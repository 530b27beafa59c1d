"""Optimization profiles and execution contexts: how several instances of one dynamic-shape engine
each get a profile they may use, on every supported TensorRT (pure; tested without TensorRT).

TensorRT's rules differ by version (the headers' ``setOptimizationProfileAsync`` notes):

- 8.5 (JetPack 5): a profile may be used by one execution context at a time. The first context
  gets profile 0 implicitly; every other context has none until it is given an unused one. So the
  engine is built with one identical profile per instance (``copies``), and instance *i* sets
  profile *i*. An engine with fewer profiles than instances cannot serve them all.
- 8.6 (JetPack 6.0): the same, unless the engine was built with the preview feature
  ``PROFILE_SHARING_0806``; then any number of contexts may use profile 0, each after
  ``set_optimization_profile_async(0, stream)``.
- 9.0 and later (JetPack 6.1+, 7): profile sharing is the default and every context starts on
  profile 0; nothing to do.

A model without dynamic inputs has no profile at all and none of this applies.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from edged.errors import BackendError

Version = tuple[int, int, int]


@dataclass(frozen=True)
class ProfileScheme:
    """How an engine's profiles are shared between execution contexts on one TensorRT version."""

    name: str  # "shared" | "sharing_0806" | "per_context"
    preview_sharing: bool  # build with PreviewFeature.PROFILE_SHARING_0806 (8.6)
    set_on_context: bool  # call set_optimization_profile_async on each new context

    def copies(self, instances: int) -> int:
        """Identical profiles the engine needs for ``instances`` concurrent contexts."""
        return max(1, instances) if self.name == "per_context" else 1


SHARED = ProfileScheme("shared", preview_sharing=False, set_on_context=False)
SHARING_0806 = ProfileScheme("sharing_0806", preview_sharing=True, set_on_context=True)
PER_CONTEXT = ProfileScheme("per_context", preview_sharing=False, set_on_context=True)


def shares_profiles_by_flag(version: Version) -> bool:
    """8.6: contexts share a profile only in an engine built with ``PROFILE_SHARING_0806`` (the
    preview feature exists in 8.6 and 10.x, not in 8.5 or 11)."""
    return (8, 6, 0) <= version < (9, 0, 0)


def profile_scheme(version: Version) -> ProfileScheme:
    if version >= (9, 0, 0):
        return SHARED
    if shares_profiles_by_flag(version):
        return SHARING_0806
    return PER_CONTEXT


class ProfileSlots:
    """Which profile each live execution context uses. ``acquire`` gives the lowest free profile
    (per_context) or 0 (shared schemes); ``release`` returns it when the context is destroyed."""

    def __init__(self, scheme: ProfileScheme, num_profiles: int, dynamic: bool, engine: str) -> None:
        self.scheme = scheme
        self.num_profiles = max(1, num_profiles)
        self.dynamic = dynamic
        self._engine = engine
        self._used: set[int] = set()
        self._lock = threading.Lock()

    def acquire(self) -> int:
        if not self.dynamic or self.scheme.name != "per_context":
            return 0
        with self._lock:
            free = [i for i in range(self.num_profiles) if i not in self._used]
            if not free:
                raise BackendError(
                    f"{self._engine}: TensorRT 8.5 gives each execution context its own "
                    f"optimization profile and this engine has {self.num_profiles}, all in use; "
                    "rebuild it for this many instances (edged builds one profile per instance "
                    "when the cache key holds the instance count) or lower instances"
                )
            self._used.add(free[0])
            return free[0]

    def release(self, index: int) -> None:
        with self._lock:
            self._used.discard(index)

    def needs_set(self, index: int, first_context: bool) -> bool:
        """Whether a context must be told its profile: 8.x contexts other than the engine's first
        start without one (and 8.5's first has profile 0 already)."""
        if not self.dynamic or not self.scheme.set_on_context:
            return False
        return not (first_context and index == 0)


class ContextLike(Protocol):
    """What ``select_profile`` asks of an ``IExecutionContext``."""

    def set_optimization_profile_async(self, profile_index: int, stream_handle: int, /) -> bool: ...


def select_profile(
    ctx: ContextLike,
    slots: ProfileSlots,
    index: int,
    first_context: bool,
    stream: int,
    synchronize: Callable[[], None],
) -> None:
    """Put a new context on its profile (on the instance's own stream, then wait for it: the
    switch is asynchronous and the first request must not race it)."""
    if not slots.needs_set(index, first_context):
        return
    if not ctx.set_optimization_profile_async(index, stream):
        raise BackendError(
            f"TensorRT refused optimization profile {index} for a new execution context "
            f"({slots.scheme.name} scheme, {slots.num_profiles} profile(s)); the TensorRT log says why"
        )
    synchronize()
