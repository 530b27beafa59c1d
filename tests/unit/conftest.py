"""Fixtures the decoder's unit tests share: an empty plan cache, and the calls a real function of a
module gets (it still runs: a count, not a fake)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from edged.wire.plans import PLANS


@pytest.fixture
def empty_plans() -> Iterator[None]:
    """The decoder's plan cache empty before the test and after it."""
    PLANS.clear()
    yield
    PLANS.clear()


@pytest.fixture
def calls_of(monkeypatch: pytest.MonkeyPatch) -> Callable[[Any, str], list[tuple[Any, ...]]]:
    """``calls_of(module, name)``: the arguments of every call of ``module.name`` from now on."""

    def spy(module: Any, name: str) -> list[tuple[Any, ...]]:
        seen: list[tuple[Any, ...]] = []
        real = getattr(module, name)

        def counted(*args: Any) -> Any:
            seen.append(args)
            return real(*args)

        monkeypatch.setattr(module, name, counted)
        return seen

    return spy
