from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from edged.tools.demo import make_tiny_mlp
from tests.helpers import DaemonProcess, write_config
from tests.string_model import make_string_model

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("models")
    make_tiny_mlp(d / "tiny.onnx")
    make_tiny_mlp(d / "tiny_b.onnx", hidden=64)
    make_string_model(d / "strings.onnx")
    return d


@pytest.fixture(scope="session")
def demo_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real demo detector, from the repository's data folder when set up there, else
    extracted from the rapidocr wheel as `scripts/demo.sh` does."""
    from edged.tools.demo import extract_detector

    local = REPO / "data" / "models" / "ocr_det.onnx"
    if local.exists():
        return local
    return extract_detector(tmp_path_factory.mktemp("demo") / "ocr_det.onnx")


@pytest.fixture
def daemons() -> Iterator[list[DaemonProcess]]:
    """The daemons a test starts, appended as it starts them, stopped (killed if stuck) after it."""
    started: list[DaemonProcess] = []
    yield started
    for d in started:
        try:
            d.stop(timeout=15)
        finally:
            d.kill()


@pytest.fixture
def daemon_factory(tmp_path: Path, daemons: list[DaemonProcess]) -> Callable[..., DaemonProcess]:
    """Build a config in tmp_path and return a not-yet-started daemon for it."""

    def make(
        models: dict[str, dict[str, Any]],
        extra: dict[str, dict[str, Any]] | None = None,
        name: str = "edged",
        env: dict[str, str] | None = None,
    ) -> DaemonProcess:
        sock = tmp_path / f"{name}.sock"
        tables: dict[str, dict[str, Any]] = {
            "server": {"socket": str(sock)},
            "cache": {"dir": str(tmp_path / "cache")},
            # Engines are built before READY=1 unless a test asks for background builds.
            "build": {"block_ready": True},
        }
        for key, values in (extra or {}).items():
            tables[key] = {**tables.get(key, {}), **values}
        for model, values in models.items():
            nested = {k: v for k, v in values.items() if isinstance(v, dict)}
            tables[f"models.{model}"] = {k: v for k, v in values.items() if not isinstance(v, dict)}
            for sub, sv in nested.items():
                for k, v in sv.items():
                    if isinstance(v, dict):
                        tables[f"models.{model}.{sub}.{k}"] = v
                    else:
                        tables.setdefault(f"models.{model}.{sub}", {})[k] = v
        cfg = write_config(tmp_path / f"{name}.toml", tables)
        d = DaemonProcess(cfg, sock, tmp_path / f"{name}.log", env=env)
        daemons.append(d)
        return d

    return make


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A socket directory other users can traverse (pytest's tmp_path is 0700 root)."""
    d = Path(tempfile.mkdtemp(prefix="edgedt-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)
