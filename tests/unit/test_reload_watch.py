"""The reloader's watch of the config file (edged/lifecycle/reload.py): a change made while a
reload runs still triggers the next one, rather than being taken as seen by it."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from edged.config import load
from edged.lifecycle.reload import Reloader


def _reloader(cfg_path: Path) -> Reloader:
    registry: Any = SimpleNamespace(cfg=load(cfg_path))  # a stand-in: the watch reads only its cfg
    return Reloader(registry, asyncio.new_event_loop(), lambda: "ready", lambda _: None, background=None)  # type: ignore[arg-type]


def test_a_change_made_during_a_reload_is_seen_after_it(tmp_path: Path) -> None:
    cfg = tmp_path / "edged.toml"
    cfg.write_text(f'[cache]\ndir = "{tmp_path / "cache"}"\n')
    reloader = _reloader(cfg)
    reloader.snapshot()
    assert reloader.changed() == []

    async def edited_meanwhile() -> None:  # the reload's work, during which the file changes
        cfg.write_text(cfg.read_text() + "# edited\n")
        os.utime(cfg, ns=(1, 1))

    reloader._reload = edited_meanwhile  # type: ignore[method-assign]
    assert asyncio.run(reloader.reload())
    assert reloader.changed() == [str(cfg)]


def test_a_reload_takes_what_it_found_as_seen(tmp_path: Path) -> None:
    cfg = tmp_path / "edged.toml"
    cfg.write_text(f'[cache]\ndir = "{tmp_path / "cache"}"\n')
    reloader = _reloader(cfg)
    reloader.snapshot()
    cfg.write_text(cfg.read_text() + "# edited\n")
    os.utime(cfg, ns=(2, 2))
    assert reloader.changed() == [str(cfg)]

    async def nothing() -> None:
        return None

    reloader._reload = nothing  # type: ignore[method-assign]
    assert asyncio.run(reloader.reload())
    assert reloader.changed() == []
