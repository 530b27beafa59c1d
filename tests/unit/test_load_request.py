"""A load request's parameters and files (edged/repository/load_request.py, uploads.py): what is
taken, what is refused and with which code, and where uploaded files land."""

from __future__ import annotations

import stat
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from edged.errors import (
    BadRequestError,
    EdgedError,
    PayloadTooLargeError,
    RepositoryPollError,
    grpc_status_of,
)
from edged.repository import uploads
from edged.repository.load_request import MAX_FILES, from_parameters, parse_config


def test_a_config_and_files_are_taken() -> None:
    req = from_parameters("m", {"config": "{}", "file:1/model.onnx": b"x", "other": True})
    assert req.given and req.config == "{}" and dict(req.files) == {"1/model.onnx": b"x"}
    assert not from_parameters("m", {"other": 1}).given


@pytest.mark.parametrize(
    ("params", "error", "said"),
    [
        ({"config": 3}, BadRequestError, "expected ModelConfig as a JSON string"),
        ({"config": "{}", "file:a": "text"}, BadRequestError, "expected the file's bytes"),
        ({"file:1/model.onnx": b"x"}, BadRequestError, "need a config beside them"),
        ({"config": "{}", **{f"file:{i}": b"" for i in range(MAX_FILES + 1)}}, PayloadTooLargeError, "at most"),
        ({"config": "{}", "file:config.pbtxt": b""}, BadRequestError, "the request's config parameter"),
        ({"config": "{}", "file:" + "a" * 256: b""}, RepositoryPollError, "longer than 255 bytes"),
        ({"config": "{}", "file:1/../../x": b""}, RepositoryPollError, "'..' component"),
        ({"config": "{}", "file:1//x": b""}, RepositoryPollError, "empty"),
        ({"config": "{}", "file:/x": b""}, RepositoryPollError, "not a relative path"),
        ({"config": "{}", "file:a\\b": b""}, RepositoryPollError, "backslash"),
        ({"config": "{}", "file:" + "/".join("a" * 9): b""}, RepositoryPollError, "at most 8"),
    ],
)
def test_what_is_refused(params: dict[str, object], error: type[EdgedError], said: str) -> None:
    with pytest.raises(error) as e:
        from_parameters("m", params)
    assert type(e.value) is error and said in e.value.message and e.value.message.startswith("failed to load 'm'")


def test_a_path_no_file_system_takes_is_answered_as_triton_answers_it() -> None:
    # Triton's simple_grpc_model_control checks for INTERNAL and these words.
    assert grpc_status_of(RepositoryPollError) == "INTERNAL" and RepositoryPollError.http_status == 500
    with pytest.raises(RepositoryPollError, match="failed to poll from model repository"):
        from_parameters("m", {"config": "{}", "file:" + "A" * 256: b"a"})


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ('{"no_such": 1}', 'has no field named "no_such"'),
        ('{"max_batch_size": "x"}', "Failed to parse max_batch_size"),
        ("[" * 100_000, "Failed to load JSON"),
        ('{"a": 1} trailing', "Failed to load JSON"),
    ],
)
def test_a_config_is_protobufs_json(text: str, said: str) -> None:
    assert parse_config("m", '{"max_batch_size": "16"}').max_batch_size == 16
    with pytest.raises(BadRequestError) as e:
        parse_config("m", text)
    assert said in e.value.message and "\n" not in e.value.message


def test_a_config_past_its_bound_is_refused() -> None:
    with pytest.raises(PayloadTooLargeError):
        parse_config("m", " " * (1 << 20) + "{}")


def _onnx(location: str | None = None) -> bytes:
    w = helper.make_tensor("w", TensorProto.FLOAT, [1], [1.0])
    if location is not None:
        w.ClearField("float_data")
        w.data_location = TensorProto.EXTERNAL
        entry = w.external_data.add()
        entry.key, entry.value = "location", location
    graph = helper.make_graph(
        [helper.make_node("Identity", ["w"], ["y"])],
        "g",
        [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        [w],
    )
    return bytes(helper.make_model(graph).SerializeToString())


def test_files_land_in_a_private_folder_of_their_own(tmp_path: Path) -> None:
    area = tmp_path / "uploads"
    first = uploads.place(area, "m", {"1/model.onnx": _onnx("w.bin"), "1/w.bin": b"\0\0\x80?"})
    second = uploads.place(area, "m", {"1/model.onnx": _onnx()})
    assert first != second and first.parent == area == second.parent
    assert (first / "1" / "w.bin").read_bytes() == b"\0\0\x80?"
    assert stat.S_IMODE((first / "1" / "model.onnx").stat().st_mode) == 0o600
    assert stat.S_IMODE(area.stat().st_mode) == 0o700
    uploads.check_external_data(first, first / "1" / "model.onnx", "m")  # w.bin is among the files
    onnx.checker.check_model(str(second / "1" / "model.onnx"))
    uploads.clear(area)
    assert list(area.iterdir()) == []


@pytest.mark.parametrize(
    ("files", "name", "error", "said"),
    [
        ({"1/model.plan": b""}, "m", BadRequestError, "edged builds TensorRT engines on this device"),
        ({"1/model.ENGINE": b""}, "m", BadRequestError, "edged builds TensorRT engines on this device"),
        ({"1/model.onnx": b"", "1/model.onnx/x": b""}, "m", RepositoryPollError, "file:1/model.onnx/x"),
        ({"1/model.onnx": b""}, "../../escape", BadRequestError, "is not a model's name"),
        ({"1/model.onnx": b""}, "/abs", BadRequestError, "is not a model's name"),
    ],
)
def test_refused_files_leave_nothing(
    tmp_path: Path, files: dict[str, bytes], name: str, error: type[EdgedError], said: str
) -> None:
    area = tmp_path / "uploads"
    with pytest.raises(error) as e:
        uploads.place(area, name, files)
    assert said in e.value.message
    assert not area.exists() or list(area.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == (["uploads"] if area.exists() else [])


@pytest.mark.parametrize(
    ("model", "said"),
    [
        (_onnx("../../secret"), "outside the uploaded files"),
        (_onnx("/etc/passwd"), "outside the uploaded files"),
        (b"not a model", "not an ONNX model"),
    ],
)
def test_a_served_onnx_model_keeps_its_data_among_the_files(tmp_path: Path, model: bytes, said: str) -> None:
    folder = uploads.place(tmp_path / "uploads", "m", {"1/model.bin": model})
    with pytest.raises(BadRequestError) as e:
        uploads.check_external_data(folder, folder / "1" / "model.bin", "m")
    assert said in e.value.message
