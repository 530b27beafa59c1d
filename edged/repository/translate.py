"""One model folder of a Triton repository turned into edged's [models.*] tables, one per
served version: the latest under the model's name, every other as ``NAME@VERSION``.

Each table comes with the config.pbtxt setting every key came from (``Served.notes``), so
that edged.toml can be merged onto it and refused where it contradicts one
(``edged.repository.overrides``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edged.config import NAME_RE, RepositoryModel
from edged.errors import ConfigError
from edged.repository import fields, pbtxt, plans, tensors, versions
from edged.repository.choice import GGUF, ONNX, PLAN, Choice, choose, model_kind
from edged.repository.signature import Signature, gguf_signature, onnx_signature
from edged.wire.proto import model_config_pb2

MAX_BATCH = 4096  # edged's max_batch at most
DEFAULT_QUEUE = 64  # edged's queue_depth by default


@dataclass(frozen=True)
class Given:
    """A model's configuration that is not its folder's config.pbtxt: a load request's."""

    name: str  # the model's
    config: model_config_pb2.ModelConfig
    where: str  # what errors name as its source


@dataclass(frozen=True)
class Override:
    """What a load request put in place of a model's repository folder, until a load without a
    config (or a restart) puts the folder's config.pbtxt back."""

    given: Given
    folder: Path  # the repository's folder of the model, or the one its uploaded files are in
    uploaded: bool


@dataclass
class Served:
    """One served version as a [models.*] table, before it is validated."""

    name: str  # the name edged serves it under: the model's, or NAME@VERSION
    raw: dict[str, Any]
    notes: dict[str, str]  # dotted key ("llm.slots") → the config.pbtxt setting it came from
    origin: RepositoryModel


def version_name(model: str, version: int, latest: int) -> str:
    return model if version == latest else f"{model}@{version}"


def translate_model(
    folder: Path,
    identity: plans.Identity = plans.tensorrt_identity,
    given: Given | None = None,
) -> list[Served]:
    """``folder``'s served versions; ``given``: a configuration from elsewhere (a load request's)
    that takes the place of its config.pbtxt, for a model of that name."""
    if given is None:
        name, where = folder.name, str(folder / "config.pbtxt")
        config = pbtxt.read(folder / "config.pbtxt")
    else:
        name, where, config = given.name, given.where, given.config
    refused = fields.refusals(config)
    if refused:
        raise ConfigError(f"{where}: {fields.explain(refused)}")
    if not NAME_RE.match(name):
        raise ConfigError(f"{folder}: a model's name is its folder's: 1-64 of [A-Za-z0-9_.-], starting alnum")
    if config.name and config.name != name:
        whose = "folder" if given is None else "model"
        raise ConfigError(f"{where}: name: '{config.name}' is not the {whose}'s name '{name}', as Triton requires")
    served = versions.served(config, versions.version_folders(folder), where)
    choice = choose(config, model_kind(config, [folder / str(v) for v in served], where), where)
    _batching(config, choice, where)
    return [
        _version(folder, name, v, version_name(name, v, served[-1]), config, choice, identity, where) for v in served
    ]


def _batching(config: model_config_pb2.ModelConfig, choice: Choice, where: str) -> None:
    batch = config.max_batch_size
    if batch > MAX_BATCH:
        raise ConfigError(f"{where}: max_batch_size: {batch}; edged batches at most {MAX_BATCH} rows")
    if batch > 0 and choice.kind == GGUF:
        raise ConfigError(
            f"{where}: max_batch_size: {batch}; a language model's concurrency is its instance_group count "
            "(its slots): set max_batch_size: 0"
        )
    if batch > 1:
        choice.set("max_batch", batch, f"max_batch_size {batch}")
        if batch > DEFAULT_QUEUE:  # room for a whole batch in the queue
            choice.set("queue_depth", batch, f"max_batch_size {batch}")
    if not config.HasField("dynamic_batching"):
        return
    if choice.kind == GGUF:
        raise ConfigError(f"{where}: dynamic_batching: a language model's slots decode together already")
    if batch == 0:
        raise ConfigError(f"{where}: dynamic_batching needs max_batch_size > 0 (the batch is the first dimension)")
    db = config.dynamic_batching
    if db.max_queue_delay_microseconds:
        delay = db.max_queue_delay_microseconds
        choice.set("max_queue_delay_us", delay, f"dynamic_batching max_queue_delay_microseconds {delay}")
    preferred = sorted(set(db.preferred_batch_size))
    wrong = [p for p in preferred if not 1 <= p <= batch]
    if wrong:
        raise ConfigError(
            f"{where}: dynamic_batching.preferred_batch_size: {wrong[0]} is not within 1..max_batch_size ({batch})"
        )
    if preferred:
        choice.set("preferred_batch", preferred, f"dynamic_batching preferred_batch_size {preferred}")


def _version(
    folder: Path,
    model: str,
    version: int,
    name: str,
    config: model_config_pb2.ModelConfig,
    choice: Choice,
    identity: plans.Identity,
    where: str,
) -> Served:
    path, backend, said, note, sig = _model_file(folder / str(version), choice, identity)
    raw: dict[str, Any] = {}
    notes = dict(choice.notes)
    for key, value in choice.keys.items():
        _put(raw, key, value)
    raw["path"], raw["backend"] = str(path), backend
    if said:
        notes["backend"] = said
    checked = tensors.Checked()
    if sig is not None:
        opt = max(choice.keys.get("preferred_batch") or [1])
        checked = tensors.check(config, sig, where, path.name, opt)
    if checked.profiles:
        raw["profiles"] = {k: dict(zip(("min", "opt", "max"), p)) for k, p in checked.profiles.items()}
        notes.update({f"profiles.{k}": f"input '{k}' dims" for k in checked.profiles})
    warm = _warmup(config, choice, sig, checked, folder, where)
    if warm:
        raw["warmup"] = warm
        notes.update({f"warmup.{k}": "model_warmup" for k in warm})
    origin = RepositoryModel(
        model=model,
        version=str(version),
        folder=str(folder),
        batched=config.max_batch_size > 0,
        input_reshape=checked.input_reshape,
        output_reshape=checked.output_reshape,
        formats=checked.formats,
        note=note,
    )
    return Served(name, raw, notes, origin)


# What serves a version: its file, the backend and the setting that chose it, a note, its tensors.
_Serving = tuple[Path, str, str, str, "Signature | None"]


def _model_file(vdir: Path, choice: Choice, identity: plans.Identity) -> _Serving:
    file = vdir / choice.file
    if not file.exists() and not (choice.kind == PLAN and (vdir / "model.onnx").exists()):
        raise ConfigError(f"{vdir}: no {choice.file} in the version folder")
    if choice.kind == ONNX and file.is_dir():  # an ONNX model with its external data: model.onnx/model.onnx
        file = file / "model.onnx"
    if choice.kind == PLAN:
        return _plan(file, choice, identity)
    sig = onnx_signature(file) if choice.kind == ONNX else gguf_signature(file)
    return file, choice.backend, choice.said, "", sig


def _plan(file: Path, choice: Choice, identity: plans.Identity) -> _Serving:
    """A version's model.plan: served as it is when its manifest matches this device; otherwise
    the model.onnx beside it, built here; with neither, the plan (which then fails, saying why)."""
    onnx = file.with_name("model.onnx")
    if not file.exists():
        note = f"no {file.name} in the version folder: serving its model.onnx, built for this device"
        return onnx, choice.onnx_backend, "", note, onnx_signature(onnx)
    why = plans.verdict(file, identity)
    if not why:
        sig = onnx_signature(onnx) if onnx.exists() else None
        return file, "tensorrt", choice.said, f"{file.name} served as it is: its manifest matches this device", sig
    if onnx.exists():
        note = f"{why}; serving the model.onnx beside it instead, built for this device"
        return onnx, choice.onnx_backend, "", note, onnx_signature(onnx)
    return file, "tensorrt", choice.said, f"{why}; there is no model.onnx beside it to build from", None


def _put(raw: dict[str, Any], dotted: str, value: Any) -> None:
    head, _, rest = dotted.partition(".")
    if rest:
        _put(raw.setdefault(head, {}), rest, value)
    else:
        raw[head] = value


def _warmup(
    config: model_config_pb2.ModelConfig,
    choice: Choice,
    sig: Signature | None,
    checked: tensors.Checked,
    folder: Path,
    where: str,
) -> dict[str, Any]:
    samples = list(config.model_warmup)
    if not samples:
        return {}
    if choice.kind == GGUF:
        raise ConfigError(
            f"{where}: model_warmup: a language model warms with llm.warmup_prompt_tokens and "
            "llm.warmup_decode_tokens (edged.toml)"
        )
    if len(samples) > 1:
        raise ConfigError(
            f"{where}: model_warmup: {len(samples)} samples; edged warms every instance with one (whose runs "
            "also measure the model's cost): keep one"
        )
    sample = samples[0]
    batch = sample.batch_size or 1
    if batch > max(config.max_batch_size, 1):
        raise ConfigError(f"{where}: model_warmup[0].batch_size: {batch} is more than max_batch_size allows")
    model_inputs = {t.name: t for t in sig.inputs} if sig is not None else {}
    given = set(sample.inputs)
    if model_inputs and given != set(model_inputs):
        wrong = sorted(given ^ set(model_inputs))[0]
        what = "is not an input of the model" if wrong in given else "has no data"
        raise ConfigError(f"{where}: model_warmup[0]: input '{wrong}' {what}")
    lead = [batch] if config.max_batch_size > 0 else []
    inputs = {
        name: _warm_input(
            name, inp, lead, checked, model_inputs.get(name), folder, f'{where}: model_warmup[0].inputs["{name}"]'
        )
        for name, inp in sample.inputs.items()
    }
    out: dict[str, Any] = {"inputs": inputs}
    if sample.count:
        out["iterations"] = sample.count
    return out


def _warm_input(
    name: str,
    inp: model_config_pb2.ModelWarmup.Input,
    lead: list[int],
    checked: tensors.Checked,
    model: Any,
    folder: Path,
    where: str,
) -> dict[str, Any]:
    dims = list(inp.dims)
    if any(d < 0 for d in dims):
        raise ConfigError(f"{where}: dims {dims}: a warm-up sample has a size for every dimension")
    if model is not None and inp.data_type != model_config_pb2.TYPE_INVALID:
        dtype = tensors.dtype_of(inp.data_type, where)
        if dtype != model.dtype:
            raise ConfigError(f"{where}: data_type {tensors.type_name(inp.data_type)} is not the input's")
    reshape = checked.input_reshape.get(name)
    inner = _reshaped(dims, reshape.model, where) if reshape is not None else dims
    shape = lead + inner
    if model is not None and (
        len(shape) != len(model.shape) or any(m not in (-1, s) for s, m in zip(shape, model.shape))
    ):
        raise ConfigError(f"{where}: dims {dims} do not fit the model's input {list(model.shape)}")
    kind = inp.WhichOneof("input_data_type")
    if kind == "input_data_file":
        data_file = folder / "warmup" / inp.input_data_file
        if not data_file.resolve().is_relative_to((folder / "warmup").resolve()):
            raise ConfigError(f"{where}: input_data_file: {inp.input_data_file[:80]!r} is not a file of warmup/")
        if not data_file.is_file():
            raise ConfigError(f"{where}: input_data_file: no file {data_file} (Triton's warmup/ folder of the model)")
        return {"shape": shape, "file": str(data_file)}
    if kind is None:
        raise ConfigError(f"{where}: no data: give zero_data, random_data or input_data_file")
    return {"shape": shape, "data": "zero" if kind == "zero_data" else "random"}


def _reshaped(dims: list[int], model: list[int], where: str) -> list[int]:
    """The model's side of a reshape for a sample of ``dims`` (a -1 there follows the count)."""
    if -1 not in model:
        return model
    known = math.prod(d for d in model if d != -1)
    total = math.prod(dims)
    if known == 0 or total % known:
        raise ConfigError(f"{where}: dims {dims} do not reshape to {model}")
    return [total // known if d == -1 else d for d in model]
