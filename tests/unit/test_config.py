from __future__ import annotations

from pathlib import Path

import pytest

from edged.config import ConfigError, from_mapping, load, parse_budget, parse_size
from tests.conftest import REPO


def err(raw: dict[str, object]) -> str:
    with pytest.raises(ConfigError) as info:
        from_mapping(raw, "edged.toml", Path("/etc/edged"))
    return info.value.message


def test_defaults_and_relative_paths(tmp_path: Path) -> None:
    (tmp_path / "edged.toml").write_text('[cache]\ndir = "c"\n[models.det]\npath = "m/det.onnx"\n')
    cfg = load(tmp_path / "edged.toml")
    assert cfg.server.socket == "/run/edged/edged.sock"
    assert cfg.server.metadata_name == "edged"
    assert cfg.cache.dir == str(tmp_path / "c")
    assert cfg.models["det"].path == str(tmp_path / "m" / "det.onnx")
    assert cfg.models["det"].precision == "fp32" and cfg.models["det"].preload == "boot"
    assert cfg.source == str(tmp_path / "edged.toml")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"models": {"det": {"path": "x", "precison": "fp32"}}}, "edged.toml: models.det.precison: unknown key"),
        ({"models": {"det": {"path": "x", "priority": 101}}}, "models.det.priority: Expected `int` <= 100"),
        ({"models": {"det": {"path": "x", "precision": "int4"}}}, "models.det.precision: Invalid enum value 'int4'"),
        ({"models": {"det": {}}}, "models.det.path: required key is missing"),
        ({"server": {"sockt": "x"}}, "server.sockt: unknown key"),
        ({"memory": {"budget": "lots"}}, "memory.budget: expected a size"),
        ({"memory": {"budget": "120%"}}, "memory.budget: a percentage must be in (0, 100]"),
        ({"server": {"socket_mode": "0666"}}, "server.socket_mode: the socket must not be world-writable"),
        (
            {"models": {"det": {"path": "x", "profiles": {"x": {"min": [1, 3], "opt": [1, 2], "max": [1, 4]}}}}},
            "models.det.profiles.x: needs min <= opt <= max",
        ),
        (
            {"models": {"det": {"path": "x", "profiles": {"x": {"min": [1], "opt": [1, 2], "max": [1, 2]}}}}},
            "models.det.profiles.x: min, opt and max must have equal rank",
        ),
        ({"models": {"bad name": {"path": "x"}}}, "models.bad name: a model name"),
        ({"mqtt": {"port": 0}}, "mqtt.port: Expected `int` >= 1"),
        ({"server": {"metadata_name": "tri ton"}}, "server.metadata_name: Expected `str` matching regex"),
        ({"server": {"metadata_name": ""}}, "server.metadata_name: Expected `str` of length >= 1"),
    ],
)
def test_errors_name_file_and_key_path(raw: dict[str, object], message: str) -> None:
    assert message in err(raw)


def test_int8_without_calibration_says_what_to_add() -> None:
    msg = err({"models": {"det": {"path": "x", "precision": "int8"}}})
    assert "models.det.precision: int8 needs calibration data" in msg
    assert "[models.det.calibration]" in msg


def test_bad_toml_and_missing_file(tmp_path: Path) -> None:
    (tmp_path / "bad.toml").write_text("[server\n")
    with pytest.raises(ConfigError, match="bad.toml: not valid TOML"):
        load(tmp_path / "bad.toml")
    with pytest.raises(ConfigError, match="cannot read config"):
        load(tmp_path / "missing.toml")


def test_sizes() -> None:
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("6GiB") == 6 << 30
    assert parse_size("1.5 GB") == 1_500_000_000
    assert parse_budget("80%", 1000) == 800
    assert parse_budget("1KiB", 10**9) == 1024
    with pytest.raises(ValueError):
        parse_size("6 parsecs")


def test_shipped_configs_are_valid() -> None:
    for name in ("edged.toml", "demo.toml"):
        cfg = load(REPO / "configs" / name)
        assert cfg.models, name
