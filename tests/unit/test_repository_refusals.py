"""What edged does not honour in a config.pbtxt is refused by the field's name, with why: every
set field of the parsed message is walked, so nothing set is silently ignored."""

from __future__ import annotations

from pathlib import Path

import pytest

from edged.errors import ConfigError
from edged.repository.fields import HONOURED, refusals
from edged.repository.load import read_repository
from edged.repository.pbtxt import parse_text
from edged.wire.proto import model_config_pb2
from tests.repository import TINY_PBTXT, model_folder, no_tensorrt


def refused(tmp_path: Path, extra: str, base: str = TINY_PBTXT) -> str:
    model_folder(tmp_path, "m", base + "\n" + extra)
    with pytest.raises(ConfigError) as caught:
        read_repository(tmp_path, no_tensorrt)
    return caught.value.message


@pytest.mark.parametrize(
    ("extra", "named", "why"),
    [
        ("sequence_batching { }", "sequence_batching", "no sequence batcher"),
        ("response_cache { enable: true }", "response_cache", "no response cache"),
        ('runtime: "libtriton_custom.so"', "runtime", "loads no backend libraries"),
        ('cc_model_filenames { key: "8.7" value: "orin.plan" }', "cc_model_filenames", "by compute capability"),
        ('metric_tags { key: "site" value: "a" }', "metric_tags", "metrics"),
        ("model_metrics { metric_control { } }", "model_metrics", "fixed buckets"),
        ('model_repository_agents { agents { name: "checksum" } }', "model_repository_agents", "file system"),
        ('model_operations { op_library_filename: "ops.so" }', "model_operations", "custom operation"),
        ('batch_input [ { target_name: "n" } ]', "batch_input", "first dimension"),
        ("optimization { cuda { graphs: true } }", "optimization.cuda", "CUDA graphs"),
        ("optimization { priority: PRIORITY_MAX }", "optimization.priority", "edged's priority key"),
        ("optimization { input_pinned_memory { enable: false } }", "optimization.input_pinned_memory", "page-locked"),
        (
            'optimization { execution_accelerators { cpu_execution_accelerator [ { name: "openvino" } ] } }',
            "optimization.execution_accelerators.cpu_execution_accelerator",
            "CPU provider",
        ),
        ("dynamic_batching { priority_levels: 2 }", "dynamic_batching.priority_levels", "no priority levels"),
        ("dynamic_batching { preserve_ordering: true }", "dynamic_batching.preserve_ordering", "as soon as"),
        (
            "dynamic_batching { default_queue_policy { max_queue_size: 4 } }",
            "dynamic_batching.default_queue_policy",
            "queue_depth and timeout_ms",
        ),
        (
            "instance_group [ { rate_limiter { priority: 2 } } ]",
            "instance_group[0].rate_limiter",
            "no rate limiter",
        ),
        (
            "instance_group [ { secondary_devices [ { kind: KIND_NVDLA device_id: 0 } ] } ]",
            "instance_group[0].secondary_devices",
            "tensorrt.dla_core",
        ),
        ('instance_group [ { host_policy: "numa0" } ]', "instance_group[0].host_policy", "host policy"),
    ],
)
def test_each_unsupported_field_is_refused_by_name(tmp_path: Path, extra: str, named: str, why: str) -> None:
    message = refused(tmp_path, extra)
    assert f"config.pbtxt: {named} is not supported: " in message
    assert why in message


def test_tensor_fields_are_refused_with_the_tensors_place(tmp_path: Path) -> None:
    base = TINY_PBTXT.replace("dims: [ 16 ] }", "dims: [ 16 ] optional: true }").replace(
        "dims: [ 4 ] }", 'dims: [ 4 ] label_filename: "labels.txt" }'
    )
    message = refused(tmp_path, "", base)
    assert "input[0].optional is not supported: edged requires every input" in message
    assert "output[0].label_filename is not supported: edged does not answer Triton's classification" in message


def test_a_refusal_names_every_refused_field_at_once(tmp_path: Path) -> None:
    message = refused(tmp_path, "response_cache { enable: true }\nsequence_batching { }", TINY_PBTXT)
    assert message.index("sequence_batching is not supported") < message.index("response_cache is not supported")


@pytest.mark.parametrize(
    ("head", "error"),
    [
        ('platform: "pytorch_libtorch"', r"platform: 'pytorch_libtorch' is not supported: edged serves ONNX"),
        ('platform: "ensemble"', r"platform: 'ensemble' is not supported: edged runs no ensembles"),
        ('backend: "python"', r"backend: 'python' is not supported: edged runs no Python models"),
        ('backend: "vllm"', r"backend: 'vllm' is not supported: a language model is a GGUF file"),
        ('platform: "onnxruntime_onnx"\nbackend: "tensorrt"', r"name different kinds"),
    ],
)
def test_platforms_and_backends_edged_does_not_run_are_refused(tmp_path: Path, head: str, error: str) -> None:
    model_folder(tmp_path, "m", head + "\n" + TINY_PBTXT.replace('platform: "onnxruntime_onnx"', ""))
    with pytest.raises(ConfigError, match=error):
        read_repository(tmp_path, no_tensorrt)


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        ("model_transaction_policy { decoupled: true }", r"model_transaction_policy.decoupled is not supported"),
        ('parameters { key: "execution_mode" value: { string_value: "1" } }', r'parameters\["execution_mode"\]'),
        (
            'optimization { execution_accelerators { gpu_execution_accelerator [ { name: "cuda" } ] } }',
            r"gpu_execution_accelerator: \[cuda\] is not supported",
        ),
        (
            'optimization { execution_accelerators { gpu_execution_accelerator [ { name: "tensorrt"'
            ' parameters { key: "trt_engine_cache_enable" value: "1" } } ] } }',
            r'parameters\["trt_engine_cache_enable"\] = "1" is not supported',
        ),
    ],
)
def test_values_edged_does_not_honour_are_refused_by_name(tmp_path: Path, extra: str, error: str) -> None:
    model_folder(tmp_path, "m", TINY_PBTXT + extra)
    with pytest.raises(ConfigError, match=error):
        read_repository(tmp_path, no_tensorrt)


def test_a_field_triton_does_not_have_is_the_parsers_error_with_its_line(tmp_path: Path) -> None:
    model_folder(tmp_path, "m", TINY_PBTXT + "\nmax_batch: 4\n")
    with pytest.raises(
        ConfigError, match=r'config.pbtxt:7:1 : Message type "inference.ModelConfig" has no field named "max_batch"'
    ):
        read_repository(tmp_path, no_tensorrt)


def test_every_field_of_the_message_is_honoured_or_has_a_reason() -> None:
    """Each field of Triton's ModelConfig is either read by the translation or refused with a
    reason of its own; one that a newer model_config.proto adds is refused as unread."""
    from edged.repository.fields import WHY, reason

    top = model_config_pb2.ModelConfig.DESCRIPTOR.fields_by_name
    assert [f for f in top if f not in HONOURED and f not in WHY] == []
    every = parse_text('name: "m" runtime: "r" response_cache { enable: true } model_metrics { }', "x")
    assert sorted(refusals(every)) == ["model_metrics", "response_cache", "runtime"]
    assert reason("a_field_of_a_newer_proto") == "edged does not read it"
