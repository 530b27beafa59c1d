"""Several instances of a dynamic-shape engine, each with a usable optimization profile, on every
supported TensorRT: the backend's profile logic (``profiles.py``, what ``_instance_impl`` runs)
against a fake engine that enforces each version's rules as TensorRT's headers state them."""

from __future__ import annotations

import functools

import pytest

from edged.backends.tensorrt.profiles import (
    PER_CONTEXT,
    SHARED,
    SHARING_0806,
    ProfileSlots,
    profile_scheme,
    select_profile,
)
from edged.errors import BackendError

V8_5, V8_6, V10_3, V11 = (8, 5, 2), (8, 6, 1), (10, 3, 0), (11, 1, 0)


class FakeEngine:
    """Fake of ``ICudaEngine`` for the profile rules alone (a unit-test stand-in, no TensorRT):

    - before 9.0 the engine's first context gets profile 0, later ones none; a profile can be
      set on one live context at a time, unless (8.6) the engine was built with
      PROFILE_SHARING_0806;
    - from 9.0 every context starts on profile 0 and any number may share it;
    - ``set_input_shape`` fails on a context without a profile (the "TensorRT refused shape"
      that instances 2..N would get without one)."""

    def __init__(self, version: tuple[int, int, int], num_profiles: int, sharing_0806: bool = False) -> None:
        self.version = version
        self.num_optimization_profiles = num_profiles
        self.sharing = version >= (9, 0, 0) or (version >= (8, 6, 0) and sharing_0806)
        self.contexts: list[FakeContext] = []

    def create_execution_context(self) -> FakeContext:
        first = not self.contexts
        ctx = FakeContext(self, 0 if (first or self.version >= (9, 0, 0)) else None)
        self.contexts.append(ctx)
        return ctx

    def in_use(self, index: int, by: FakeContext) -> bool:
        return any(c is not by and c.profile == index and c.alive for c in self.contexts)


class FakeContext:
    def __init__(self, engine: FakeEngine, profile: int | None) -> None:
        self.engine = engine
        self.profile = profile
        self.alive = True
        self.streams: list[int] = []

    def set_optimization_profile_async(self, profile_index: int, stream_handle: int, /) -> bool:
        if not 0 <= profile_index < self.engine.num_optimization_profiles:
            return False
        if not self.engine.sharing and self.engine.in_use(profile_index, self):
            return False
        self.profile = profile_index
        self.streams.append(stream_handle)
        return True

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        return self.alive and self.profile is not None

    def destroy(self) -> None:
        self.alive = False


def open_instances(engine: FakeEngine, version: tuple[int, int, int], n: int) -> list[tuple[FakeContext, int]]:
    """What ``TensorRTBackend`` does for ``n`` instances: the first takes the context made at
    load (the spare), each gets a profile slot, a context and its profile, then serves."""
    slots = ProfileSlots(profile_scheme(version), engine.num_optimization_profiles, True, "m.engine")
    spare: FakeContext | None = engine.create_execution_context()
    opened = []
    syncs: list[int] = []
    for i in range(n):
        index = slots.acquire()
        ctx, spare = (spare, None) if spare is not None else (engine.create_execution_context(), None)
        first = i == 0
        select_profile(ctx, slots, index, first, stream=100 + i, synchronize=functools.partial(syncs.append, i))
        assert ctx.set_input_shape("x", (2, 16)), f"instance {i} has no usable profile"
        opened.append((ctx, index))
    return opened


def test_each_version_gets_its_scheme() -> None:
    assert profile_scheme(V8_5) is PER_CONTEXT
    assert profile_scheme(V8_6) is SHARING_0806
    assert profile_scheme(V10_3) is SHARED and profile_scheme(V11) is SHARED
    assert PER_CONTEXT.copies(3) == 3 and SHARING_0806.copies(3) == 1 and SHARED.copies(3) == 1


def test_the_fake_fails_as_the_issue_says_without_the_scheme() -> None:
    """The control: on 8.6 without profile sharing, a second context never gets profile 0."""
    engine = FakeEngine(V8_6, num_profiles=1, sharing_0806=False)
    engine.create_execution_context()
    second = engine.create_execution_context()
    assert not second.set_input_shape("x", (1, 16))
    assert not second.set_optimization_profile_async(0, 7)


def test_8_5_serves_n_instances_from_n_profiles() -> None:
    engine = FakeEngine(V8_5, num_profiles=PER_CONTEXT.copies(3))
    opened = open_instances(engine, V8_5, 3)
    assert [index for _, index in opened] == [0, 1, 2]
    assert [c.profile for c, _ in opened] == [0, 1, 2]
    assert opened[0][0].streams == []  # the first context is on profile 0 already
    assert opened[1][0].streams == [101] and opened[2][0].streams == [102]  # on its own stream


def test_8_5_with_too_few_profiles_says_what_to_do() -> None:
    engine = FakeEngine(V8_5, num_profiles=2)
    with pytest.raises(BackendError, match=r"has 2, all in use; rebuild it for this many instances"):
        open_instances(engine, V8_5, 3)


def test_8_5_reuses_a_released_profile() -> None:
    engine = FakeEngine(V8_5, num_profiles=2)
    slots = ProfileSlots(PER_CONTEXT, 2, True, "m.engine")
    first = engine.create_execution_context()
    assert slots.acquire() == 0
    second = engine.create_execution_context()
    index = slots.acquire()
    select_profile(second, slots, index, False, 5, lambda: None)
    second.destroy()
    slots.release(index)
    third = engine.create_execution_context()
    index = slots.acquire()
    assert index == 1
    select_profile(third, slots, index, False, 6, lambda: None)
    assert third.set_input_shape("x", (1, 16)) and first.profile == 0


@pytest.mark.parametrize("n", [1, 2, 5])
def test_8_6_shares_profile_0_when_built_with_profile_sharing(n: int) -> None:
    engine = FakeEngine(V8_6, num_profiles=SHARING_0806.copies(n), sharing_0806=SHARING_0806.preview_sharing)
    opened = open_instances(engine, V8_6, n)
    assert {c.profile for c, _ in opened} == {0}
    assert all(c.streams == [100 + i] for i, (c, _) in enumerate(opened) if i > 0)


@pytest.mark.parametrize("version", [V10_3, V11])
def test_10_and_later_serve_any_instances_as_today(version: tuple[int, int, int]) -> None:
    engine = FakeEngine(version, num_profiles=1)
    opened = open_instances(engine, version, 6)
    assert all(c.profile == 0 and c.streams == [] for c, _ in opened)  # no profile calls at all


def test_static_engines_never_touch_profiles() -> None:
    slots = ProfileSlots(PER_CONTEXT, 1, dynamic=False, engine="m.engine")
    assert [slots.acquire() for _ in range(4)] == [0, 0, 0, 0]
    assert not slots.needs_set(0, first_context=False)


def test_a_refused_profile_is_a_backend_error() -> None:
    class Refuses:
        def set_optimization_profile_async(self, profile_index: int, stream_handle: int, /) -> bool:
            return False

    slots = ProfileSlots(SHARING_0806, 1, True, "m.engine")
    with pytest.raises(BackendError, match="refused optimization profile 0"):
        select_profile(Refuses(), slots, 0, False, 1, lambda: None)
