"""Which edged backend runs a repository model, and with what, from config.pbtxt's platform,
backend, instance_group, execution accelerators and parameters.

| config.pbtxt | edged |
| --- | --- |
| ``platform: "onnxruntime_onnx"`` / ``backend: "onnxruntime"`` | an ONNX model (``model.onnx``): ``auto`` |
| ``platform: "tensorrt_plan"`` / ``backend: "tensorrt"`` | a TensorRT plan (``model.plan``): ``tensorrt`` |
| ``backend: "llama"`` | a GGUF language model (``model.gguf``): ``llama`` |
| ``instance_group { kind: KIND_CPU }`` | an ONNX model on ``onnxruntime`` |
| ``instance_group { kind: KIND_GPU }`` | an ONNX model on ``tensorrt`` (edged's GPU path is an engine it builds) |
| ``gpu_execution_accelerator [{ name: "tensorrt" }]`` | an ONNX model on ``tensorrt`` (``precision_mode``) |
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edged.errors import ConfigError
from edged.wire.proto import model_config_pb2

ONNX, PLAN, GGUF = "onnx", "plan", "gguf"
DEFAULT_FILES = {ONNX: "model.onnx", PLAN: "model.plan", GGUF: "model.gguf"}
_PLATFORMS = {"onnxruntime_onnx": ONNX, "tensorrt_plan": PLAN}
_BACKENDS = {"onnxruntime": ONNX, "tensorrt": PLAN, "llama": GGUF}
_SUFFIXES = {".onnx": ONNX, ".plan": PLAN, ".engine": PLAN, ".gguf": GGUF}
_OTHERS = {
    "python": "edged runs no Python models",
    "vllm": 'a language model is a GGUF file on edged\'s llama backend (backend: "llama")',
    "tensorrtllm": 'a language model is a GGUF file on edged\'s llama backend (backend: "llama")',
    "ensemble": "edged runs no ensembles: call each model from the client in turn",
}
_SERVED = "edged serves ONNX models, TensorRT plans and GGUF language models"

Group = model_config_pb2.ModelInstanceGroup
KIND_NAMES: dict[int, str] = {Group.KIND_AUTO: "KIND_AUTO", Group.KIND_GPU: "KIND_GPU", Group.KIND_CPU: "KIND_CPU"}


@dataclass
class Choice:
    """What runs the model: the file kind, edged's backend and the keys the choice sets, with
    the config.pbtxt setting each came from in ``notes`` (``edged.toml`` may not contradict them)."""

    kind: str
    file: str
    backend: str = "auto"  # for the model file of ``kind``
    said: str = ""  # the setting that chose it ("" : edged's default)
    # A plan's model.onnx, built here when the plan cannot be served as it is, runs on this.
    onnx_backend: str = "auto"
    keys: dict[str, Any] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    def set(self, key: str, value: Any, said: str) -> None:
        self.keys[key] = value
        self.notes[key] = said

    def run_on(self, backend: str, said: str) -> None:
        self.backend, self.said = backend, said


def model_kind(config: model_config_pb2.ModelConfig, versions: list[Path], where: str) -> str:
    """ONNX, PLAN or GGUF: from the platform and the backend, else from the files present."""
    kinds = []
    for key, value, table in (("platform", config.platform, _PLATFORMS), ("backend", config.backend, _BACKENDS)):
        if not value:
            continue
        if value not in table:
            why = _OTHERS.get(value, _SERVED)
            raise ConfigError(f"{where}: {key}: '{value}' is not supported: {why}")
        kinds.append(table[value])
    if kinds and len(set(kinds)) > 1:
        raise ConfigError(f"{where}: platform '{config.platform}' and backend '{config.backend}' name different kinds")
    if kinds:
        return kinds[0]
    name = config.default_model_filename
    if name and Path(name).suffix.lower() in _SUFFIXES:
        return _SUFFIXES[Path(name).suffix.lower()]
    for folder in reversed(versions):  # the newest version's file decides, as it is served by default
        found = [kind for kind, default in DEFAULT_FILES.items() if (folder / default).exists()]
        if len(found) == 1 or (found and set(found) == {ONNX, PLAN}):
            return PLAN if PLAN in found else found[0]
    raise ConfigError(
        f"{where}: no platform or backend, and no model.onnx, model.plan or model.gguf in the version folders "
        f"to tell what the model is ({_SERVED})"
    )


def choose(config: model_config_pb2.ModelConfig, kind: str, where: str) -> Choice:
    name = config.default_model_filename
    if name and (name in (".", "..") or "/" in name or "\\" in name or "\0" in name):
        # As in Triton, a file of the version folder: a path would reach outside the repository.
        raise ConfigError(f"{where}: default_model_filename: {name[:80]!r} is not a file name of the version folder")
    choice = Choice(kind, name or DEFAULT_FILES[kind])
    group_kind = _instances(config, choice, where)
    if kind == GGUF:
        choice.run_on("llama", f"backend {config.backend}" if config.backend else "a model.gguf")
    elif kind == PLAN:
        if group_kind == Group.KIND_CPU:
            raise ConfigError(f"{where}: instance_group kind KIND_CPU: a TensorRT plan runs on the GPU")
        choice.run_on("tensorrt", f"platform {config.platform}" if config.platform else "a TensorRT plan")
        if group_kind == Group.KIND_GPU:
            choice.onnx_backend = "tensorrt"
    elif group_kind == Group.KIND_CPU:
        choice.run_on("onnxruntime", "instance_group kind KIND_CPU")
    elif group_kind == Group.KIND_GPU:
        choice.run_on("tensorrt", "instance_group kind KIND_GPU")
    _accelerators(config, choice, group_kind, where)
    _parameters(config, choice, where)
    if config.model_transaction_policy.decoupled and kind != GGUF:
        raise ConfigError(
            f"{where}: model_transaction_policy.decoupled is not supported: edged answers each request once "
            "(only a language model streams, through generate_stream)"
        )
    return choice


def _instances(config: model_config_pb2.ModelConfig, choice: Choice, where: str) -> int:
    """instance_group: its count becomes instances (a language model's slots), its kind is returned."""
    groups = list(config.instance_group)
    if not groups:
        return Group.KIND_AUTO
    if len(groups) > 1:
        raise ConfigError(
            f"{where}: instance_group: {len(groups)} groups; edged runs one group of instances per model "
            "(merge them into one, with the sum of their counts)"
        )
    group = groups[0]
    if group.kind not in KIND_NAMES:
        raise ConfigError(f"{where}: instance_group kind KIND_MODEL is not supported: edged places instances itself")
    if choice.kind == GGUF and group.kind != Group.KIND_AUTO:
        _llama_kind(group.kind, where)
    said = f"instance_group count {group.count}"
    count = group.count or (2 if group.kind == Group.KIND_CPU and choice.kind == ONNX else 1)
    if not 1 <= count <= 64:
        raise ConfigError(f"{where}: instance_group count {group.count}: edged runs 1 to 64 instances")
    if choice.kind == GGUF:
        choice.set("llm.slots", count, said)
    elif group.count or count != 1:
        choice.set("instances", count, said if group.count else "instance_group kind KIND_CPU (2 by default)")
    if len(group.gpus) > 1:
        raise ConfigError(
            f"{where}: instance_group gpus {list(group.gpus)}: edged runs a model on one GPU (give one, or run "
            "one edged per GPU)"
        )
    if group.gpus:
        if group.kind == Group.KIND_CPU or choice.kind == GGUF:
            raise ConfigError(f"{where}: instance_group gpus: only a TensorRT model is placed on a GPU")
        choice.set("tensorrt.device", group.gpus[0], f"instance_group gpus [{group.gpus[0]}]")
    return int(group.kind)


def llama_offloads() -> bool | None:
    """Whether edged's llama.cpp runs a language model on the GPU: it offloads every layer where
    its build can, and none where it cannot. None without llama.cpp (the model fails saying so)."""
    from edged import backends

    try:
        return backends.backend_class("llama").fingerprint().get("gpu_offload") == "True"
    except Exception:  # not installed, or a library that does not load: resolving the model says why
        return None


def _llama_kind(kind: int, where: str) -> None:
    """A language model's instance kind holds only where llama.cpp runs it anyway."""
    offloads = llama_offloads()
    if offloads is not None and offloads != (kind == Group.KIND_GPU):
        runs = (
            "on the GPU (its build offloads every layer)" if offloads else "on the CPU (its build has no GPU offload)"
        )
        raise ConfigError(
            f"{where}: instance_group kind {KIND_NAMES[kind]}: edged's llama.cpp runs language models {runs}; "
            "use KIND_AUTO, or no kind"
        )


_PRECISIONS = {"FP32": "fp32", "FP16": "fp16", "INT8": "int8"}


def _accelerators(config: model_config_pb2.ModelConfig, choice: Choice, group_kind: int, where: str) -> None:
    accels = list(config.optimization.execution_accelerators.gpu_execution_accelerator)
    if not accels:
        return
    key = "optimization.execution_accelerators.gpu_execution_accelerator"
    if choice.kind != ONNX or len(accels) > 1 or accels[0].name != "tensorrt":
        names = ", ".join(a.name for a in accels)
        raise ConfigError(
            f"{where}: {key}: [{names}] is not supported: edged's GPU path for an ONNX model is one "
            'TensorRT engine it builds ([{{ name: "tensorrt" }}])'
        )
    if group_kind == Group.KIND_CPU:
        raise ConfigError(f"{where}: {key}: TensorRT with instance_group kind KIND_CPU: one or the other")
    choice.run_on("tensorrt", f"{key} tensorrt")
    for name, value in accels[0].parameters.items():
        if name == "precision_mode" and value.upper() in _PRECISIONS:
            choice.set("precision", _PRECISIONS[value.upper()], f"{key} precision_mode {value}")
        elif name == "max_workspace_size_bytes" and value.isdecimal():
            choice.set("tensorrt.workspace", f"{int(value)}B", f"{key} max_workspace_size_bytes {value}")
        else:
            raise ConfigError(
                f'{where}: {key} parameters["{name}"] = "{value}" is not supported: edged reads precision_mode '
                "(FP32, FP16, INT8) and max_workspace_size_bytes; its own TensorRT keys go in edged.toml"
            )


def _parameters(config: model_config_pb2.ModelConfig, choice: Choice, where: str) -> None:
    for name, value in config.parameters.items():
        text = value.string_value
        if choice.kind == ONNX and name == "intra_op_thread_count" and text.isdecimal():
            choice.set("threads", int(text), f'parameters["intra_op_thread_count"] {text}')
            continue
        raise ConfigError(
            f'{where}: parameters["{name}"] = "{text}" is not supported: edged reads intra_op_thread_count '
            "of an ONNX model; its own keys go in edged.toml"
        )
