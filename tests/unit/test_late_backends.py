"""A backend whose library is installed after start (edged/backends/__init__.py, edged/serving/waiting.py):
what the import system finds for it, on a real folder on sys.path, and when a waiting model's
library is imported: only once its files settled, and again only once they change."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edged import backends
from edged.cache.store import EngineCache
from edged.config import from_mapping, load
from edged.host.memory import probe_meminfo
from edged.lifecycle.boot import Boot
from edged.lifecycle.readiness import summary, unready
from edged.lifecycle.reload import Reloader
from edged.quantize.runner import BuildRunner
from edged.serving.background import BackgroundBuilds
from edged.serving.metrics import Metrics
from edged.serving.registry import Registry
from edged.serving.states import ModelState
from edged.serving.waiting import BackendWaits
from edged.tools.demo import make_tiny_mlp
from tests.helpers import write_config

LIB = "edged_unit_late_lib"  # a package this test writes into a folder on sys.path


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder on sys.path, and a late backend "unitlate" whose edged module is LIB itself."""
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setitem(backends.LATE_LIBRARIES, "unitlate", (LIB, "edged-unit-late"))
    monkeypatch.setitem(backends.BACKENDS, "unitlate", f"{LIB}:Backend")
    yield folder
    for name in [m for m in sys.modules if m == LIB or m.startswith(LIB + ".")]:
        del sys.modules[name]
    backends._resolved.pop("unitlate", None)


def write_lib(folder: Path, body: str) -> None:
    pkg = folder / LIB
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text(body)


def test_a_package_installed_after_start_is_found_and_its_changes_seen(site: Path) -> None:
    assert backends.library_files(LIB) is None
    write_lib(site, "class Backend: pass\n")
    first = backends.library_files(LIB)  # found without a restart: the finders' caches dropped
    assert first is not None and [Path(p).name for p, _, _ in first] == ["__init__.py"]
    (site / LIB / "more.py").write_text("X = 1\n")
    second = backends.library_files(LIB)
    assert second is not None and second != first  # still being written: another file
    __import__(LIB + ".more")  # writes __pycache__/: bytecode is not the install changing
    assert backends.library_files(LIB) == second


def test_a_late_backend_is_chosen_for_its_config_and_waits_only_while_missing(site: Path) -> None:
    assert backends.chosen("auto", "m.gguf") == "llama"
    assert backends.chosen("auto", "m.onnx") is None  # auto tries candidates: nothing to wait for
    assert backends.late_library("onnxruntime") is None
    waiting = backends.waiting_for("unitlate")
    assert waiting == (
        "unitlate",
        f"backend unitlate is not installed yet: {LIB} (from edged-unit-late) is not importable",
    )
    write_lib(site, "raise ImportError('half written')\n")
    waiting = backends.waiting_for("unitlate")
    assert waiting is not None and "cannot be imported: half written" in waiting[1]
    write_lib(site, "class Backend: pass\n")
    assert backends.waiting_for("unitlate") is None
    assert backends.late_library("unitlate") is None  # imported: never waited for again


def waits(tmp_path: Path) -> BackendWaits:
    cfg = from_mapping({"models": {"a": {"path": "a.onnx"}}}, base=tmp_path)
    reg = Registry(cfg, EngineCache(tmp_path / "cache"), BuildRunner(cfg.build, probe_meminfo), Metrics(), 1 << 30)
    loop = asyncio.new_event_loop()
    loop.close()  # _look needs no loop; the object only keeps it
    return BackendWaits(reg, loop, lambda rt, load: None, lambda name: False, lambda: None)


def test_the_library_is_imported_once_its_files_settle_and_again_only_when_they_change(
    site: Path, tmp_path: Path
) -> None:
    w = waits(tmp_path)
    assert w._look("unitlate").startswith("backend unitlate is not installed yet")
    # Half written: it raises on import. Seen once, it is not imported yet (pip may still write).
    write_lib(site, "import edged_unit_late_lib.missing_part\n")
    assert "being installed" in w._look("unitlate")
    assert LIB not in sys.modules
    # Unchanged for one look: imported, and the error is the reason.
    error = w._look("unitlate")
    assert "cannot be imported" in error and "missing_part" in error and "tried again" in error
    # Same files: not imported again (a broken install is not re-run every few seconds).
    (site / "counter").write_text("0")
    write_lib(site, f"open({str(site / 'counter')!r}, 'a').write('1')\nimport edged_unit_late_lib.missing_part\n")
    assert "being installed" in w._look("unitlate")
    assert "missing_part" in w._look("unitlate")
    assert w._look("unitlate") == w._look("unitlate")
    assert (site / "counter").read_text() == "01"  # one import of these files, not three
    # Completed: it imports, and the backend class resolves.
    write_lib(site, "class Backend: pass\n")
    assert "being installed" in w._look("unitlate")
    assert w._look("unitlate") == ""
    assert backends.backend_class("unitlate").__name__ == "Backend"


def test_a_waiting_model_has_settled_and_the_summary_says_what_it_waits_for(tmp_path: Path) -> None:
    models = {"vision": {"path": "v.onnx"}, "lm": {"path": "m.gguf"}}
    cfg = from_mapping({"models": models}, base=tmp_path)
    reg = Registry(cfg, EngineCache(tmp_path / "cache"), BuildRunner(cfg.build, probe_meminfo), Metrics(), 1 << 30)
    vision, lm = reg.models["vision"], reg.models["lm"]
    lm.state, lm.reason = ModelState.WAITING, backends.not_installed_text("llama")
    assert unready(reg) == "vision is pending"  # it waits for the vision model, not for the library
    vision.state = ModelState.READY
    assert unready(reg) == ""
    assert summary(reg, []) == "1 models ready, 1 waiting: backend llama is not installed yet"
    vision.state = ModelState.FAILED
    assert unready(reg) == "no boot model serves"  # a waiting model does not serve


@pytest.fixture
def llama_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """llama's library as a module nothing provides, and llama not imported in this process."""
    monkeypatch.setitem(backends.LATE_LIBRARIES, "llama", ("edged_unit_absent_lib", "llama-cpp-python"))
    monkeypatch.delitem(backends._resolved, "llama", raising=False)


def test_boot_serves_the_others_and_a_reload_keeps_the_model_waiting(tmp_path: Path, llama_missing: None) -> None:
    make_tiny_mlp(tmp_path / "v.onnx")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")  # never read while its backend is missing
    tables: dict[str, dict[str, Any]] = {
        "cache": {"dir": str(tmp_path / "cache")},
        "lifecycle": {"watch_files": False},
        "models.vision": {"path": str(tmp_path / "v.onnx"), "backend": "onnxruntime"},
        "models.vision.warmup": {"iterations": 1},
        "models.lm": {"path": str(tmp_path / "m.gguf"), "priority": 60},
    }
    cfg_path = write_config(tmp_path / "edged.toml", tables)
    cfg = load(cfg_path)
    reg = Registry(cfg, EngineCache(cfg.cache.dir), BuildRunner(cfg.build, probe_meminfo), Metrics(), 1 << 30)
    missing = backends.not_installed_text("llama")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        builds = BackgroundBuilds(reg, loop, lambda: None, lambda: None)
        the_plan = await Boot(reg, builds, loop).boot()
        assert "lm" not in the_plan.admitted  # outside the plan until its backend imports
        lm = reg.models["lm"]
        assert (reg.models["vision"].state, lm.state, lm.reason) == (ModelState.READY, ModelState.WAITING, missing)
        assert unready(reg) == "" and lm.to_dict()["backend"] == "llama"
        reloader = Reloader(reg, loop, lambda: "", lambda _: None, builds)
        assert await reloader.reload()  # nothing changed: the same runtime waits on
        assert reg.models["lm"] is lm and lm.state == ModelState.WAITING
        tables["models.lm"]["priority"] = 70
        write_config(cfg_path, tables)
        assert await reloader.reload()  # changed: the new version waits, as the old one did
        new = reg.models["lm"]
        assert new is not lm and (new.state, new.reason, new.cfg.priority) == (ModelState.WAITING, missing, 70)
        assert reg.models["vision"].state == ModelState.READY and unready(reg) == ""
        await builds.stop()
        await reg.unload(reg.models["vision"])

    asyncio.run(main())
