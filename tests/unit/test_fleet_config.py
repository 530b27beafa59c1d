"""The [fleet] table: defaults that keep a single device's unsigned models working, trust paths
resolved against the config's folder, and the rules between its keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from edged.config import from_mapping, load
from edged.errors import ConfigError
from edged.fleet.bundle import BundleLimits


def test_without_a_fleet_table_bundles_need_no_signature(tmp_path: Path) -> None:
    cfg = from_mapping({"models": {"tiny": {"path": "tiny.onnx"}}}, base=tmp_path)
    assert cfg.fleet.require_signed is False and cfg.fleet.trust == []
    assert cfg.models["tiny"].path == str(tmp_path / "tiny.onnx")


def test_trust_paths_resolve_against_the_config_folder(tmp_path: Path) -> None:
    (tmp_path / "edged.toml").write_text('[fleet]\ntrust = ["keys/release.pub", "/etc/edged/ca.crt"]\n')
    cfg = load(tmp_path / "edged.toml")
    assert cfg.fleet.trust_paths == [tmp_path.resolve() / "keys" / "release.pub", Path("/etc/edged/ca.crt")]


@pytest.mark.parametrize(
    ("table", "words"),
    [
        ({"require_signed": True}, "fleet: require_signed = true needs at least one path in fleet.trust"),
        ({"max_bundle_size": "lots"}, "fleet.max_bundle_size"),
        ({"max_bundle_files": 0}, "fleet.max_bundle_files"),
        ({"trusted": []}, "fleet.trusted: unknown key"),
    ],
)
def test_a_bad_fleet_table_names_the_key(table: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_mapping({"fleet": table}, "edged.toml")
    assert words in info.value.message


def test_the_limits_come_from_the_table() -> None:
    cfg = from_mapping({"fleet": {"max_bundle_size": "2GiB", "max_bundle_files": 50}})
    assert BundleLimits.from_config(cfg.fleet) == BundleLimits(max_bytes=2 << 30, max_files=50)
