"""<repository>/edged.toml adds edged's own keys to a repository's models; a key that contradicts
config.pbtxt is an error naming both. And the repository joined to the main config."""

from __future__ import annotations

from pathlib import Path

import pytest

from edged.config import from_mapping
from edged.errors import ConfigError
from edged.repository.load import load_config, read_repository
from tests.repository import TINY_PBTXT, model_folder, no_tensorrt


def with_toml(root: Path, text: str, pbtxt: str = TINY_PBTXT) -> Path:
    model_folder(root, "m", pbtxt + "version_policy: { all { } }", {1: "model.onnx", 2: "model.onnx"})
    (root / "edged.toml").write_text(text)
    return root


def test_edged_keys_apply_to_every_version(tmp_path: Path) -> None:
    with_toml(
        tmp_path,
        """[models.m]
        priority = 80
        preload = "lazy"
        precision = "int8"
        timeout_ms = 500
        [models.m.calibration]
        data = "calibration/m"
        [models.m.gate]
        metric = "top1"
        """,
    )
    models, _ = read_repository(tmp_path, no_tensorrt)
    for name in ("m", "m@1"):
        m = models[name]
        assert (m.priority, m.preload, m.precision, m.timeout_ms, m.gate.metric) == (80, "lazy", "int8", 500, "top1")
        assert m.calibration is not None and m.calibration.data == str(tmp_path / "calibration" / "m")


def test_a_key_config_pbtxt_decides_may_repeat_its_value(tmp_path: Path) -> None:
    with_toml(tmp_path, "[models.m]\nmax_batch = 8\n")
    assert read_repository(tmp_path, no_tensorrt)[0]["m"].max_batch == 8


@pytest.mark.parametrize(
    ("toml", "pbtxt", "error"),
    [
        ("[models.m]\nmax_batch = 4\n", "", r"models.m.max_batch = 4 contradicts config.pbtxt's max_batch_size 8"),
        (
            "[models.m]\ninstances = 1\n",
            "instance_group [ { count: 3 kind: KIND_CPU } ]",
            r"models.m.instances = 1 contradicts config.pbtxt's instance_group count 3 \(which makes it 3\)",
        ),
        (
            '[models.m]\nbackend = "tensorrt"\n',
            "instance_group [ { kind: KIND_CPU } ]",
            r"models.m.backend = 'tensorrt' contradicts config.pbtxt's instance_group kind KIND_CPU",
        ),
        (
            "[models.m.warmup]\niterations = 1\n",
            'model_warmup [ { name: "w" count: 4 inputs { key: "x" value: { dims: [ 16 ] zero_data: true } } } ]',
            r"models.m.warmup.iterations = 1 contradicts config.pbtxt's model_warmup",
        ),
        ('[models.m]\npath = "other.onnx"\n', "", r"models.m.path: a repository model's file is its version folder's"),
        ("[models.other]\npriority = 1\n", "", r"edged.toml: models.other: the repository has no such model"),
        ("[server]\ntcp = []\n", "", r"edged.toml: server: only \[models.NAME\] tables belong here"),
        ("[models.m]\npriority = 101\n", "", r"edged.toml: models.m.priority: Expected `int` <= 100"),
        (
            "[models.m.profiles.x]\nmin = [1, 16]\nopt = [4, 16]\nmax = [16, 16]\n",
            "",
            r"models.m.profiles.x: min \[1, 16\] / max \[16, 16\] go beyond config.pbtxt's input 'x' dims",
        ),
    ],
)
def test_contradictions_and_strays_are_errors_naming_both(tmp_path: Path, toml: str, pbtxt: str, error: str) -> None:
    with_toml(tmp_path, toml, TINY_PBTXT + pbtxt)
    with pytest.raises(ConfigError, match=error):
        read_repository(tmp_path, no_tensorrt)


def test_a_profile_may_narrow_what_config_pbtxt_allows(tmp_path: Path) -> None:
    with_toml(tmp_path, "[models.m.profiles.x]\nmin = [2, 16]\nopt = [4, 16]\nmax = [4, 16]\n")
    prof = read_repository(tmp_path, no_tensorrt)[0]["m"].profiles["x"]
    assert (prof.min, prof.opt, prof.max) == ([2, 16], [4, 16], [4, 16])


def test_the_repository_joins_the_main_config(tmp_path: Path) -> None:
    model_folder(tmp_path / "repo", "m", TINY_PBTXT)
    model_folder(tmp_path, "own", None)
    main = tmp_path / "edged.toml"
    main.write_text('[server]\nmodel_repository = "repo"\n[models.tiny]\npath = "own/1/model.onnx"\n')
    cfg = load_config(main, identity=no_tensorrt)
    assert cfg.server.model_repository == str(tmp_path / "repo")
    assert sorted(cfg.models) == ["m", "tiny"] and cfg.repository["m"].model == "m"
    assert "tiny" not in cfg.repository


def test_a_command_lines_repository_takes_the_place_of_the_configs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_folder(tmp_path / "a", "from_a", TINY_PBTXT)
    model_folder(tmp_path / "b", "from_b", TINY_PBTXT)
    main = tmp_path / "edged.toml"
    main.write_text('[server]\nmodel_repository = "a"\n')
    monkeypatch.chdir(tmp_path)
    cfg = load_config(main, "b", no_tensorrt)
    # Kept resolved, so that a reload reads the same folder wherever the daemon runs from.
    assert list(cfg.models) == ["from_b"] and cfg.repository_arg == str(tmp_path / "b")


def test_one_name_in_both_is_an_error(tmp_path: Path) -> None:
    model_folder(tmp_path / "repo", "m", TINY_PBTXT)
    main = tmp_path / "edged.toml"
    main.write_text(f'[server]\nmodel_repository = "repo"\n[models.m]\npath = "{tmp_path}/repo/m/1/model.onnx"\n')
    with pytest.raises(ConfigError, match=r"edged.toml: models.m: the model repository .* has a model 'm' too"):
        load_config(main, identity=no_tensorrt)


def test_a_missing_repository_is_an_error(tmp_path: Path) -> None:
    main = tmp_path / "edged.toml"
    main.write_text('[server]\nmodel_repository = "nowhere"\n')
    with pytest.raises(ConfigError, match=r"nowhere: the model repository is not a folder"):
        load_config(main, identity=no_tensorrt)


@pytest.mark.parametrize("key", ["repository", "repository_arg", "source"])
def test_the_loaders_keys_cannot_come_from_a_file(key: str) -> None:
    with pytest.raises(ConfigError, match=rf"x.toml: {key}: unknown key"):
        from_mapping({key: {}}, "x.toml")
