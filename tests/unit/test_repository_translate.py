"""A Triton model repository turned into edged's model tables: every honoured config.pbtxt field,
checked against the model file's own tensors (real ONNX files made with the onnx helper API)."""

from __future__ import annotations

from pathlib import Path

import pytest

from edged.config import ModelConfig, RepositoryModel, Reshape, WarmupInput
from edged.errors import ConfigError
from edged.repository.load import read_repository
from tests.repository import CHAT_PBTXT, TINY_PBTXT, gguf_header, identity_model, model_folder, no_tensorrt


def read(root: Path) -> tuple[dict[str, ModelConfig], dict[str, RepositoryModel]]:
    return read_repository(root, no_tensorrt)


def one(root: Path, name: str = "m") -> ModelConfig:
    return read(root)[0][name]


def test_a_minimal_onnx_model_keeps_edged_defaults(tmp_path: Path) -> None:
    model_folder(tmp_path, "m", TINY_PBTXT)
    m = one(tmp_path)
    assert m.path == str(tmp_path / "m" / "1" / "model.onnx")
    assert (m.backend, m.instances, m.max_batch, m.max_queue_delay_us, m.preferred_batch) == ("auto", 1, 8, 0, [])
    # The batch dimension is Triton's max_batch_size; the config's dims fix the rest.
    assert (m.profiles["x"].min, m.profiles["x"].opt, m.profiles["x"].max) == ([1, 16], [1, 16], [8, 16])


def test_the_default_policy_serves_the_latest_version_alone(tmp_path: Path) -> None:
    model_folder(tmp_path, "m", TINY_PBTXT, {1: "model.onnx", 2: "model.onnx", 3: "model.onnx"})
    for not_a_version in ("0", "01", "v4"):
        (tmp_path / "m" / not_a_version).mkdir()
    models, origins = read(tmp_path)
    assert list(models) == ["m"]
    assert models["m"].path.endswith("/m/3/model.onnx")
    assert origins["m"] == RepositoryModel(model="m", version="3", folder=str(tmp_path / "m"), batched=True)


@pytest.mark.parametrize(
    ("policy", "served"),
    [
        ("version_policy: { all { } }", {"m@1": "1", "m@2": "2", "m": "3"}),
        ("version_policy: { latest { num_versions: 2 } }", {"m@2": "2", "m": "3"}),
        ("version_policy: { specific { versions: [ 1, 3 ] } }", {"m@1": "1", "m": "3"}),
    ],
)
def test_version_policies_name_each_served_version(tmp_path: Path, policy: str, served: dict[str, str]) -> None:
    model_folder(tmp_path, "m", TINY_PBTXT + policy, {1: "model.onnx", 2: "model.onnx", 3: "model.onnx"})
    models, origins = read(tmp_path)
    assert {name: o.version for name, o in origins.items()} == served
    assert all(models[name].path.endswith(f"/m/{v}/model.onnx") for name, v in served.items())


def test_a_specific_version_without_its_folder_is_refused(tmp_path: Path) -> None:
    model_folder(tmp_path, "m", TINY_PBTXT + "version_policy: { specific { versions: [ 2 ] } }")
    with pytest.raises(ConfigError, match=r"version_policy.specific.versions: version 2 has no folder"):
        read(tmp_path)


def test_name_must_be_the_folders(tmp_path: Path) -> None:
    model_folder(tmp_path, "m", 'name: "other"\n' + TINY_PBTXT)
    with pytest.raises(ConfigError, match=r"config.pbtxt: name: 'other' is not the folder's name 'm'"):
        read(tmp_path)


@pytest.mark.parametrize(
    ("group", "backend", "instances"),
    [
        ("instance_group [ { count: 3 kind: KIND_CPU } ]", "onnxruntime", 3),
        ("instance_group [ { kind: KIND_CPU } ]", "onnxruntime", 2),  # Triton's ONNX Runtime default on the CPU
        ("instance_group [ { count: 2 kind: KIND_GPU } ]", "tensorrt", 2),
        ("instance_group [ { count: 2 } ]", "auto", 2),
    ],
)
def test_instance_groups_give_instances_and_the_backend(
    tmp_path: Path, group: str, backend: str, instances: int
) -> None:
    model_folder(tmp_path, "m", TINY_PBTXT + group)
    m = one(tmp_path)
    assert (m.backend, m.instances) == (backend, instances)


def test_one_gpu_of_an_instance_group_is_tensorrts_device(tmp_path: Path) -> None:
    model_folder(tmp_path, "m", TINY_PBTXT + "instance_group [ { kind: KIND_GPU gpus: [ 1 ] } ]")
    m = one(tmp_path)
    assert (m.backend, m.tensorrt.device) == ("tensorrt", 1)


@pytest.mark.parametrize(
    ("group", "error"),
    [
        ("instance_group [ { kind: KIND_CPU }, { kind: KIND_GPU } ]", r"instance_group: 2 groups"),
        ("instance_group [ { kind: KIND_GPU gpus: [ 0, 1 ] } ]", r"instance_group gpus \[0, 1\]"),
        ("instance_group [ { kind: KIND_MODEL } ]", r"instance_group kind KIND_MODEL"),
        ("instance_group [ { count: 65 } ]", r"instance_group count 65"),
    ],
)
def test_instance_groups_edged_cannot_run_are_refused(tmp_path: Path, group: str, error: str) -> None:
    model_folder(tmp_path, "m", TINY_PBTXT + group)
    with pytest.raises(ConfigError, match=error):
        read(tmp_path)


def test_dynamic_batching_gives_delay_and_preferred_sizes(tmp_path: Path) -> None:
    pbtxt = TINY_PBTXT + "dynamic_batching { preferred_batch_size: [ 4, 2 ] max_queue_delay_microseconds: 500 }"
    model_folder(tmp_path, "m", pbtxt)
    m = one(tmp_path)
    assert (m.max_batch, m.max_queue_delay_us, m.preferred_batch) == (8, 500, [2, 4])
    assert m.profiles["x"].opt == [4, 16]  # engines are tuned for the largest preferred batch


@pytest.mark.parametrize(
    ("pbtxt", "error"),
    [
        (
            TINY_PBTXT + "dynamic_batching { preferred_batch_size: [ 16 ] }",
            r"preferred_batch_size: 16 is not within 1..max_batch_size \(8\)",
        ),
        (
            TINY_PBTXT.replace("max_batch_size: 8", "max_batch_size: 0").replace("[ 16 ]", "[ -1, 16 ]")
            + "dynamic_batching { }",
            r"dynamic_batching needs max_batch_size > 0",
        ),
        (TINY_PBTXT.replace("max_batch_size: 8", "max_batch_size: 5000"), r"max_batch_size: 5000; edged batches"),
    ],
)
def test_batching_edged_cannot_do_is_refused(tmp_path: Path, pbtxt: str, error: str) -> None:
    model_folder(tmp_path, "m", pbtxt)
    with pytest.raises(ConfigError, match=error):
        read(tmp_path)


def test_a_large_max_batch_size_makes_room_in_the_queue(tmp_path: Path) -> None:
    model_folder(tmp_path, "m", TINY_PBTXT.replace("max_batch_size: 8", "max_batch_size: 128"))
    m = one(tmp_path)
    assert (m.max_batch, m.queue_depth) == (128, 128)


@pytest.mark.parametrize(
    ("edit", "error"),
    [
        (
            ("TYPE_FP32 dims: [ 16 ]", "TYPE_FP16 dims: [ 16 ]"),
            r"input 'x': data_type TYPE_FP16 but model.onnx has TYPE_FP32",
        ),
        (("dims: [ 16 ]", "dims: [ 15 ]"), r"input 'x': dims \[15\] after the batch dimension does not fit"),
        (("dims: [ 4 ]", "dims: [ 4, 1 ]"), r"output 'probs': dims \[4, 1\] after the batch dimension does not fit"),
        (('name: "x"', 'name: "image"'), r"input 'image': model.onnx has no such input \(its inputs: x\)"),
        (("dims: [ 16 ]", "dims: [ 0 ]"), r"input 'x': dims \[0\]: a dimension is a positive size or -1"),
    ],
)
def test_tensors_that_do_not_fit_the_model_file_are_refused_by_name(
    tmp_path: Path, edit: tuple[str, str], error: str
) -> None:
    model_folder(tmp_path, "m", TINY_PBTXT.replace(*edit))
    with pytest.raises(ConfigError, match=error):
        read(tmp_path)


def test_a_tensor_the_config_leaves_out_is_refused(tmp_path: Path) -> None:
    model_folder(tmp_path, "m", TINY_PBTXT.replace('output [ { name: "probs" data_type: TYPE_FP32 dims: [ 4 ] } ]', ""))
    models, _ = read(tmp_path)  # no outputs listed: the model's own, as Triton completes them
    assert "m" in models
    pbtxt = TINY_PBTXT.replace("max_batch_size: 8", "max_batch_size: 0")
    identity_model(tmp_path / "two" / "1" / "model.onnx", ["N", 4])
    (tmp_path / "two" / "config.pbtxt").write_text(
        pbtxt.replace("[ 16 ]", "[ -1, 4 ]").replace('name: "probs"', 'name: "y"').replace("[ 4 ] }", "[ -1, 4 ] }")
        + 'output [ { name: "z" data_type: TYPE_FP32 dims: [ 1 ] } ]'
    )
    with pytest.raises(ConfigError, match=r"output 'z': model.onnx has no such output"):
        read(tmp_path)


def test_max_batch_size_needs_a_dynamic_first_dimension(tmp_path: Path) -> None:
    identity_model(tmp_path / "m" / "1" / "model.onnx", [1, 16])
    (tmp_path / "m" / "config.pbtxt").write_text("max_batch_size: 4\n")
    with pytest.raises(
        ConfigError, match=r"max_batch_size: 4 says the first dimension is a batch, but model.onnx fixes it for 'x'"
    ):
        read(tmp_path)


def test_reshape_is_checked_against_the_model_and_kept(tmp_path: Path) -> None:
    identity_model(tmp_path / "m" / "1" / "model.onnx", ["N"])
    (tmp_path / "m" / "config.pbtxt").write_text(
        """max_batch_size: 8
        input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] reshape: { shape: [ ] } } ]
        output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] reshape: { shape: [ ] } } ]"""
    )
    models, origins = read(tmp_path)
    assert origins["m"].input_reshape == {"x": Reshape(api=[1], model=[])}
    assert origins["m"].output_reshape == {"y": Reshape(api=[1], model=[])}
    assert models["m"].profiles["x"].max == [8]  # the model's own shape


def test_a_reshape_of_another_size_is_refused(tmp_path: Path) -> None:
    identity_model(tmp_path / "m" / "1" / "model.onnx", ["N", 6])
    (tmp_path / "m" / "config.pbtxt").write_text(
        'max_batch_size: 8\ninput [ { name: "x" data_type: TYPE_FP32 dims: [ 2, 2 ] reshape: { shape: [ 6 ] } } ]'
    )
    with pytest.raises(ConfigError, match=r"input 'x': reshape \[6\] holds 6 elements, dims \[2, 2\] 4"):
        read(tmp_path)


def test_no_config_pbtxt_is_completed_from_the_model(tmp_path: Path) -> None:
    model_folder(tmp_path, "m", None)
    m = one(tmp_path)
    assert (m.path.endswith("/m/1/model.onnx"), m.backend, m.max_batch) == (True, "auto", 1)


def test_default_model_filename_names_the_file(tmp_path: Path) -> None:
    model_folder(tmp_path, "m", TINY_PBTXT + 'default_model_filename: "mlp.onnx"', {1: "mlp.onnx"})
    assert one(tmp_path).path.endswith("/m/1/mlp.onnx")


def test_a_missing_model_file_is_refused(tmp_path: Path) -> None:
    model_folder(tmp_path, "m", TINY_PBTXT, {1: "other.onnx"})
    with pytest.raises(ConfigError, match=r"m/1: no model.onnx in the version folder"):
        read(tmp_path)


def test_an_onnx_model_with_its_data_in_a_folder(tmp_path: Path) -> None:
    model_folder(tmp_path, "m", TINY_PBTXT, {1: "model.onnx/model.onnx"})
    assert one(tmp_path).path.endswith("/m/1/model.onnx/model.onnx")


def test_tensorrt_accelerator_runs_on_tensorrt_at_its_precision(tmp_path: Path) -> None:
    accel = """optimization { execution_accelerators { gpu_execution_accelerator : [ {
        name : "tensorrt"
        parameters { key: "precision_mode" value: "FP16" }
        parameters { key: "max_workspace_size_bytes" value: "1073741824" } } ] } }"""
    model_folder(tmp_path, "m", TINY_PBTXT + accel)
    m = one(tmp_path)
    assert (m.backend, m.precision, m.tensorrt.workspace) == ("tensorrt", "fp16", "1073741824B")


def test_intra_op_thread_count_is_threads(tmp_path: Path) -> None:
    model_folder(tmp_path, "m", TINY_PBTXT + 'parameters { key: "intra_op_thread_count" value: { string_value: "2" } }')
    assert one(tmp_path).threads == 2


def test_warmup_samples_become_warmup_inputs(tmp_path: Path) -> None:
    sample = """model_warmup [ { name: "zeros" batch_size: 2 count: 5
        inputs { key: "x" value: { data_type: TYPE_FP32 dims: [ 16 ] zero_data: true } } } ]"""
    model_folder(tmp_path, "m", TINY_PBTXT + sample)
    m = one(tmp_path)
    assert m.warmup.iterations == 5
    assert m.warmup.inputs == {"x": WarmupInput(shape=[2, 16], data="zero")}


def test_a_warmup_data_file_is_read_from_the_models_warmup_folder(tmp_path: Path) -> None:
    sample = """model_warmup [ { name: "file" batch_size: 1
        inputs { key: "x" value: { data_type: TYPE_FP32 dims: [ 16 ] input_data_file: "x.raw" } } } ]"""
    folder = model_folder(tmp_path, "m", TINY_PBTXT + sample)
    with pytest.raises(ConfigError, match=r"input_data_file: no file .*m/warmup/x.raw"):
        read(tmp_path)
    (folder / "warmup").mkdir()
    (folder / "warmup" / "x.raw").write_bytes(bytes(64))
    assert one(tmp_path).warmup.inputs == {"x": WarmupInput(shape=[1, 16], file=str(folder / "warmup" / "x.raw"))}


@pytest.mark.parametrize(
    ("sample", "error"),
    [
        (
            'model_warmup [ { name: "a" inputs { key: "x" value: { dims: [ 16 ] zero_data: true } } },'
            ' { name: "b" inputs { key: "x" value: { dims: [ 16 ] zero_data: true } } } ]',
            r"model_warmup: 2 samples",
        ),
        (
            'model_warmup [ { name: "a" inputs { key: "z" value: { dims: [ 16 ] zero_data: true } } } ]',
            r"model_warmup\[0\]: input 'x' has no data",
        ),
        (
            'model_warmup [ { name: "a" batch_size: 9 inputs { key: "x" value: { dims: [ 16 ] zero_data: true } } } ]',
            r"batch_size: 9 is more than max_batch_size allows",
        ),
        (
            'model_warmup [ { name: "a" inputs { key: "x" value: { dims: [ 12 ] random_data: true } } } ]',
            r'inputs\["x"\]: dims \[12\] do not fit',
        ),
    ],
)
def test_warmup_samples_edged_cannot_run_are_refused(tmp_path: Path, sample: str, error: str) -> None:
    model_folder(tmp_path, "m", TINY_PBTXT + sample)
    with pytest.raises(ConfigError, match=error):
        read(tmp_path)


@pytest.fixture
def gpu_llama(monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp built with GPU offload, whatever this machine's build is."""
    monkeypatch.setattr("edged.repository.choice.llama_offloads", lambda: True)


def test_a_gguf_is_a_language_model_with_slots(tmp_path: Path, gpu_llama: None) -> None:
    gguf_header(tmp_path / "chat" / "1" / "model.gguf")
    (tmp_path / "chat" / "config.pbtxt").write_text(CHAT_PBTXT + "instance_group [ { count: 2 kind: KIND_GPU } ]")
    m = one(tmp_path, "chat")
    assert (m.backend, m.path.endswith("/chat/1/model.gguf")) == ("llama", True)
    assert m.llm is not None and (m.llm.slots, m.instances) == (2, 2)


def test_a_language_models_kind_must_be_where_llama_cpp_runs_it(tmp_path: Path, gpu_llama: None) -> None:
    gguf_header(tmp_path / "chat" / "1" / "model.gguf")
    (tmp_path / "chat" / "config.pbtxt").write_text(CHAT_PBTXT + "instance_group [ { kind: KIND_CPU } ]")
    with pytest.raises(
        ConfigError, match=r"instance_group kind KIND_CPU: edged's llama.cpp runs language models on the GPU"
    ):
        read(tmp_path)


def test_a_gguf_found_in_the_version_folder_needs_no_config(tmp_path: Path) -> None:
    gguf_header(tmp_path / "chat" / "1" / "model.gguf")
    assert one(tmp_path, "chat").backend == "llama"


@pytest.mark.parametrize(
    ("pbtxt", "error"),
    [
        ('backend: "llama"\nmax_batch_size: 4', r"max_batch_size: 4; a language model's concurrency"),
        (
            'backend: "llama"\ninput [ { name: "prompt" data_type: TYPE_STRING dims: [ 1 ] } ]',
            r"input 'prompt': model.gguf has no such input \(its inputs: text_input\)",
        ),
        (
            'backend: "llama"\nmodel_warmup [ { name: "w"'
            ' inputs { key: "text_input" value: { dims: [ 1 ] zero_data: true } } } ]',
            r"model_warmup: a language model warms with llm.warmup_prompt_tokens",
        ),
    ],
)
def test_language_model_settings_edged_does_otherwise_are_refused(tmp_path: Path, pbtxt: str, error: str) -> None:
    gguf_header(tmp_path / "chat" / "1" / "model.gguf")
    (tmp_path / "chat" / "config.pbtxt").write_text(pbtxt)
    with pytest.raises(ConfigError, match=error):
        read(tmp_path)


def test_a_model_gguf_that_is_not_one_is_refused(tmp_path: Path) -> None:
    (tmp_path / "chat" / "1").mkdir(parents=True)
    (tmp_path / "chat" / "1" / "model.gguf").write_bytes(b"not a gguf")
    (tmp_path / "chat" / "config.pbtxt").write_text('backend: "llama"')
    with pytest.raises(ConfigError, match=r"model.gguf is not a readable GGUF file"):
        read(tmp_path)


def test_hidden_folders_and_files_are_not_models(tmp_path: Path) -> None:
    model_folder(tmp_path, "m", TINY_PBTXT)
    (tmp_path / ".git").mkdir()
    (tmp_path / "README.md").write_text("models")
    assert list(read(tmp_path)[0]) == ["m"]


def test_a_model_folder_with_no_version_is_refused(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.pbtxt").write_text(TINY_PBTXT)
    with pytest.raises(ConfigError, match=r"no version folder \(1/, 2/, ...\) holds the model"):
        read(tmp_path)


def test_an_inputs_format_is_kept_for_clients(tmp_path: Path) -> None:
    model_folder(tmp_path, "m", TINY_PBTXT.replace("dims: [ 16 ] }", "dims: [ 16 ] format: FORMAT_NHWC }"))
    assert read(tmp_path)[1]["m"].formats == {"x": "FORMAT_NHWC"}


def test_dims_narrower_than_the_model_where_no_profile_can_say_so_are_checked_per_request(tmp_path: Path) -> None:
    identity_model(tmp_path / "m" / "1" / "model.onnx", ["N", "C", "W"])
    (tmp_path / "m" / "config.pbtxt").write_text(
        'max_batch_size: 8\ninput [ { name: "x" data_type: TYPE_FP32 dims: [ 4, -1 ] } ]'
    )
    models, origins = read(tmp_path)
    assert origins["m"].input_reshape == {"x": Reshape(api=[4, -1], model=[4, -1])}
    assert models["m"].profiles == {}
