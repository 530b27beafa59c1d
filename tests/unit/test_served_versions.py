"""What a name and a version mean: a repository model's versions, the default being the latest,
and a TOML model's version 1; a repository's reshapes on the request path; warm-up inputs given
one by one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edged.backends.base import TensorSpec
from edged.config import Config, ModelConfig, RepositoryModel, Reshape, WarmupConfig, WarmupInput
from edged.errors import ConfigError, InvalidInputError, ModelNotFoundError, ModelVersionNotFoundError
from edged.serving.reshape import reshaper
from edged.serving.versions import Versions, origin_doc, served_config
from edged.serving.warmup import concrete_shape, warm_inputs


def config() -> Config:
    def origin(version: str, note: str = "") -> RepositoryModel:
        return RepositoryModel(model="m", version=version, folder="/r/m", note=note)

    models = {n: ModelConfig(path=f"/r/{n}.onnx") for n in ("m@1", "m@3", "m", "tiny")}
    return Config(models=models, repository={"m@3": origin("3"), "m@1": origin("1"), "m": origin("10", "why")})


REGISTERED = ("m@1", "m@3", "m", "tiny")


def test_the_default_is_the_latest_and_each_version_has_its_model() -> None:
    v = Versions.of_config(config())
    assert list(v.of["m"]) == ["1", "3", "10"]  # ascending by number, not as text
    assert v.resolve("m", "", REGISTERED) == "m"
    assert [v.resolve("m", n, REGISTERED) for n in ("1", "3", "10")] == ["m@1", "m@3", "m"]
    assert v.served("m@3") == ("m", "3") and v.served("m") == ("m", "10")


def test_a_version_that_is_no_integer_is_refused_in_tritons_words() -> None:
    versions = Versions.of_config(Config())
    with pytest.raises(InvalidInputError, match="failed to get model version from specified version string 'x1'"):
        versions.resolve("m", "x1", {"m"})


def test_an_unserved_version_is_version_not_found_naming_those_served() -> None:
    with pytest.raises(ModelVersionNotFoundError, match=r"model 'm' has no version '2'; it serves version 1, 3, 10"):
        Versions.of_config(config()).resolve("m", "2", REGISTERED)


def test_a_toml_model_serves_version_1_and_an_unknown_model_is_not_found() -> None:
    v = Versions.of_config(config())
    assert v.resolve("tiny", "1", REGISTERED) == "tiny" and v.served("tiny") == ("tiny", "1")
    with pytest.raises(ModelVersionNotFoundError, match="serves version 1$"):
        v.resolve("tiny", "2", REGISTERED)
    with pytest.raises(ModelNotFoundError):
        v.resolve("nope", "1", REGISTERED)


def test_a_version_of_its_own_name_is_only_its_own() -> None:
    v = Versions.of_config(config())
    assert v.resolve("m@3", "3", REGISTERED) == "m@3"
    with pytest.raises(ModelVersionNotFoundError):
        v.resolve("m@3", "1", REGISTERED)


def test_metadata_lists_ready_versions_for_the_default_and_one_for_another() -> None:
    v = Versions.of_config(config())
    assert v.listed("m", lambda n: n != "m@3") == ["1", "10"]
    assert v.listed("m@3", lambda n: True) == ["3"]
    assert v.listed("tiny", lambda n: True) == ["1"]


def test_load_and_unload_mean_every_version() -> None:
    v = Versions.of_config(config())
    assert v.every("m", REGISTERED) == ["m@1", "m@3", "m"] and v.every("tiny", REGISTERED) == ["tiny"]


def test_status_says_where_a_repository_model_comes_from() -> None:
    assert origin_doc(config(), "m") == {"model": "m", "version": "10", "folder": "/r/m", "note": "why"}
    assert origin_doc(config(), "tiny") is None


def batched_reshape() -> RepositoryModel:
    return RepositoryModel(
        model="m",
        version="1",
        folder="/r/m",
        batched=True,
        input_reshape={"x": Reshape(api=[1], model=[])},
        output_reshape={"y": Reshape(api=[2, 2], model=[4])},
    )


def test_inputs_reach_the_model_in_its_shape_and_outputs_leave_in_the_configs() -> None:
    r = reshaper(batched_reshape())
    assert r is not None
    inputs = r.to_model({"x": np.arange(3, dtype=np.float32).reshape(3, 1)})
    assert inputs["x"].shape == (3,)
    assert r.to_api({"y": np.zeros((3, 4), np.float32)})["y"].shape == (3, 2, 2)
    assert r.shown("y", (-1, 4), output=True) == (-1, 2, 2) and r.shown("x", (-1,), output=False) == (-1, 1)


def test_an_input_not_in_the_configs_dims_is_invalid() -> None:
    r = reshaper(batched_reshape())
    assert r is not None
    with pytest.raises(InvalidInputError, match=r"input 'x': shape \[3, 2\] does not match \[\?, 1\]"):
        r.to_model({"x": np.zeros((3, 2), np.float32)})


def test_a_model_without_reshapes_has_no_reshaper() -> None:
    assert reshaper(RepositoryModel(model="m", version="1", folder="/r/m")) is None
    assert reshaper(None) is None


SPECS = (TensorSpec("x", "float32", (-1, 16)), TensorSpec("t", "object", (-1,)))


def model_with(inputs: dict[str, WarmupInput]) -> ModelConfig:
    return ModelConfig(path="/m.onnx", warmup=WarmupConfig(inputs=inputs))


def test_warmup_inputs_given_one_by_one(tmp_path: Path) -> None:
    raw = tmp_path / "x.raw"
    raw.write_bytes(np.arange(32, dtype=np.float32).tobytes())
    model = model_with({"x": WarmupInput(shape=[2, 16], file=str(raw)), "t": WarmupInput(shape=[3], data="zero")})
    got = warm_inputs(SPECS, model)
    assert np.array_equal(got["x"], np.arange(32, dtype=np.float32).reshape(2, 16))
    assert got["t"].shape == (3,) and got["t"].dtype == object
    assert concrete_shape(SPECS[0], model) == (2, 16)


def test_warmup_inputs_that_are_not_the_models_are_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"warm-up inputs \['x'\] are not the model's inputs \['x', 't'\]"):
        warm_inputs(SPECS, model_with({"x": WarmupInput(shape=[1, 16])}))
    raw = tmp_path / "short.raw"
    raw.write_bytes(bytes(8))
    short = model_with({"x": WarmupInput(shape=[1, 16], file=str(raw)), "t": WarmupInput(shape=[1])})
    with pytest.raises(ConfigError, match=r"warm-up input 'x' .*needs 64 bytes, got 8"):
        warm_inputs(SPECS, short)


def test_the_configuration_clients_read_is_config_pbtxts() -> None:
    """A batched model whose queue does not batch (max_batch_size 1) still leaves the batch out of
    its dims, reshaped tensors show their dims, inputs their formats."""
    tensor = {"name": "x", "data_type": "TYPE_FP32", "format": "FORMAT_NONE", "dims": [-1]}
    out = {"name": "y", "data_type": "TYPE_FP32", "dims": [-1, 4]}
    doc = {"name": "m@1", "max_batch_size": 0, "input": [tensor], "output": [out], "version_policy": {}}
    origin = batched_reshape()
    origin = RepositoryModel(
        **{**{f: getattr(origin, f) for f in origin.__struct_fields__}, "formats": {"x": "FORMAT_NCHW"}}
    )
    got = served_config(doc, origin, 1, ["1", "2"])
    assert (got["name"], got["max_batch_size"], got["version_policy"]) == ("m", 1, {"specific": {"versions": [1, 2]}})
    assert (got["input"][0]["dims"], got["input"][0]["format"]) == ([1], "FORMAT_NCHW")
    assert got["output"][0]["dims"] == [2, 2]


def test_narrower_dims_are_checked_and_shown() -> None:
    narrowed = RepositoryModel(
        model="m", version="1", folder="/r/m", batched=True, input_reshape={"x": Reshape(api=[4, -1], model=[4, -1])}
    )
    r = reshaper(narrowed)
    assert r is not None
    assert r.to_model({"x": np.zeros((2, 4, 7), np.float32)})["x"].shape == (2, 4, 7)
    with pytest.raises(InvalidInputError, match=r"input 'x': shape \[2, 5, 7\] does not match \[\?, 4, \?\]"):
        r.to_model({"x": np.zeros((2, 5, 7), np.float32)})
    assert r.shown("x", (-1, -1, -1), output=False) == (-1, 4, -1)
