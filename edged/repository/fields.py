"""What edged honours of a config.pbtxt, field by field, and why it refuses the rest.

``refusals`` walks every field the parsed message has set (``ListFields``), down to nested
messages, repeated elements and map values: a set field that is not in ``HONOURED`` is refused,
by its path and with the reason below, so that nothing set in a config.pbtxt is silently ignored.
Fields that are honoured only for some backends or values are checked where they are read
(``edged.repository.translate``).
"""

from __future__ import annotations

import re
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

# A message's honoured fields; None: a scalar, or a message read whole where it is translated.
Spec = dict[str, "Spec | None"]

_TENSOR: Spec = {"name": None, "data_type": None, "dims": None, "reshape": None}

HONOURED: Spec = {
    "name": None,
    "platform": None,
    "backend": None,
    "max_batch_size": None,
    "default_model_filename": None,
    "version_policy": None,
    # format is a label for clients (Triton's ONNX Runtime and TensorRT backends do not read it).
    "input": {**_TENSOR, "format": None},
    "output": _TENSOR,
    "dynamic_batching": {"preferred_batch_size": None, "max_queue_delay_microseconds": None},
    "instance_group": {"name": None, "kind": None, "count": None, "gpus": None},
    "model_warmup": {
        "name": None,
        "batch_size": None,
        "count": None,
        "inputs": {"data_type": None, "dims": None, "zero_data": None, "random_data": None, "input_data_file": None},
    },
    "parameters": None,
    "optimization": {"execution_accelerators": {"gpu_execution_accelerator": {"name": None, "parameters": None}}},
    "model_transaction_policy": {"decoupled": None},
}

_BUILDS_ITSELF = "edged builds and tunes its TensorRT engines itself (docs/tensorrt.md)"
_NO_PRIORITY = "edged's model queue has no priority levels: requests run in arrival order"

WHY: dict[str, str] = {
    "runtime": "edged loads no backend libraries: its backends are onnxruntime, tensorrt and llama",
    "sequence_batching": "edged has no sequence batcher: it answers each request on its own, keeping no state",
    "ensemble_scheduling": "edged runs no ensembles: call each model from the client (or DeepStream) in turn",
    "batch_input": "edged batches by joining requests along the first dimension only",
    "batch_output": "edged batches by joining requests along the first dimension only",
    "cc_model_filenames": (
        "edged picks no plan by compute capability: it serves a model.plan whose manifest matches this "
        "device, or builds the engine here from model.onnx"
    ),
    "metric_tags": "edged's metrics carry the model's name, nothing else",
    "model_metrics": "edged's metrics have fixed buckets (docs/protocol.md)",
    "model_repository_agents": "edged reads the repository from the local file system as it is",
    "model_operations": "edged loads no custom operation libraries",
    "response_cache": "edged keeps no response cache: every request runs the model",
    "input.is_shape_tensor": "edged serves no shape tensors",
    "output.is_shape_tensor": "edged serves no shape tensors",
    "input.allow_ragged_batch": "edged batches only requests of the same shapes",
    "input.optional": "edged requires every input of a model in every request",
    "input.is_non_linear_format_io": "edged's tensors are linear (row-major)",
    "output.is_non_linear_format_io": "edged's tensors are linear (row-major)",
    "output.label_filename": "edged does not answer Triton's classification extension",
    "dynamic_batching.preserve_ordering": "edged answers each request as soon as its batch has run",
    "dynamic_batching.priority_levels": _NO_PRIORITY,
    "dynamic_batching.default_priority_level": _NO_PRIORITY,
    "dynamic_batching.priority_queue_policy": _NO_PRIORITY,
    "dynamic_batching.default_queue_policy": (
        "edged's queue is bounded by queue_depth and timeout_ms: set them in edged.toml"
    ),
    "instance_group.rate_limiter": "edged has no rate limiter: a model's queue_depth bounds what it holds",
    "instance_group.secondary_devices": "a DLA core is tensorrt.dla_core in edged.toml",
    "instance_group.profile": _BUILDS_ITSELF,
    "instance_group.passive": "every instance edged loads serves",
    "instance_group.host_policy": "edged has one host policy: its own",
    "optimization.graph": _BUILDS_ITSELF,
    "optimization.priority": "a model's priority is edged's priority key (edged.toml): admission to the memory budget",
    "optimization.cuda": "CUDA graphs and streams are TensorRT's inside edged's backend, " + _BUILDS_ITSELF,
    "optimization.input_pinned_memory": "edged's TensorRT backend keeps page-locked buffers of its own",
    "optimization.output_pinned_memory": "edged's TensorRT backend keeps page-locked buffers of its own",
    "optimization.gather_kernel_buffer_threshold": "edged copies inputs its own way",
    "optimization.eager_batching": "edged's batcher waits at most max_queue_delay_microseconds, then runs",
    "optimization.execution_accelerators.cpu_execution_accelerator": (
        "edged runs ONNX Runtime with its CPU provider as it is"
    ),
}

_INDEX_RE = re.compile(r"\[[^\]]*\]")


def _is_map(field: FieldDescriptor) -> bool:
    return field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def refusals(message: Message, spec: Spec = HONOURED, path: str = "") -> list[str]:
    """The paths of ``message``'s set fields that ``spec`` does not honour (``input[1].optional``,
    ``model_warmup[0].inputs["x"].dims``), in the order the message holds them."""
    out: list[str] = []
    for field, value in message.ListFields():
        where = f"{path}.{field.name}" if path else field.name
        if field.name not in spec:
            out.append(where)
            continue
        sub = spec[field.name]
        if sub is None or field.type != FieldDescriptor.TYPE_MESSAGE:
            continue
        out += _nested(field, value, sub, where)
    return out


def _nested(field: FieldDescriptor, value: Any, sub: Spec, where: str) -> list[str]:
    if _is_map(field):
        if field.message_type.fields_by_name["value"].type != FieldDescriptor.TYPE_MESSAGE:
            return []
        return [p for key, item in value.items() for p in refusals(item, sub, f'{where}["{key}"]')]
    if field.is_repeated:
        return [p for i, item in enumerate(value) for p in refusals(item, sub, f"{where}[{i}]")]
    return refusals(value, sub, where)


def reason(path: str) -> str:
    """Why the field at ``path`` is refused."""
    key = _INDEX_RE.sub("", path)
    while key:
        if WHY.get(key):
            return WHY[key]
        key = key.rpartition(".")[0]
    return "edged does not read it"


def explain(paths: list[str]) -> str:
    """The refused fields, each with its reason, for one error message."""
    return "; ".join(f"{p} is not supported: {reason(p)}" for p in paths)
