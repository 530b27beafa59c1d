"""A model's tables: [models.NAME] and its warm-up, calibration, gate, TensorRT and llm tables, and
what a Triton repository adds to a model."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from edged.config.base import Backend, NonNegInt, PositiveFloat, PositiveInt, Precision, Table


class ShapeProfile(Table, frozen=True):
    """min/opt/max shapes of one input with dynamic dimensions (TensorRT optimisation profile)."""

    min: list[PositiveInt]
    opt: list[PositiveInt]
    max: list[PositiveInt]


class WarmupInput(Table, frozen=True):
    """One input of a warm-up sample described per input (a Triton ``model_warmup`` sample):
    its whole shape, batch included, and its data."""

    shape: list[NonNegInt]
    data: Literal["random", "zero"] = "random"
    # A file of the tensor's raw bytes, row-major (BYTES: 4-byte little-endian lengths, each
    # followed by its element), in place of ``data``.
    file: str = ""


class WarmupConfig(Table, frozen=True):
    iterations: NonNegInt = 3
    # "random" (inputs drawn at the opt shape), the path of a .npy/.npz sample file, or a table
    # of inputs by name, each with its own shape and data.
    inputs: str | dict[str, WarmupInput] = "random"


class CalibrationConfig(Table, frozen=True):
    data: str
    method: Literal["minmax", "entropy", "percentile"] = "minmax"
    percentile: Annotated[float, msgspec.Meta(gt=90.0, le=100.0)] = 99.999
    max_samples: PositiveInt = 256
    # Images only: how to turn an image file into the model's input tensor.
    resize: list[PositiveInt] = msgspec.field(default_factory=list)
    layout: Literal["NCHW", "NHWC"] = "NCHW"
    color: Literal["RGB", "BGR"] = "RGB"
    scale: float = 1.0 / 255.0
    mean: list[float] = msgspec.field(default_factory=lambda: [0.0, 0.0, 0.0])
    std: list[float] = msgspec.field(default_factory=lambda: [1.0, 1.0, 1.0])


GateMetric = Literal["rel_l2", "cosine", "top1", "mask_iou", "det_f1"]
Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]


class GateConfig(Table, frozen=True):
    # What "close enough to FP32" means for the task; several metrics must all pass.
    metric: GateMetric | list[GateMetric] = msgspec.field(default_factory=lambda: ["rel_l2", "cosine", "top1"])
    max_rel_l2: PositiveFloat = 0.05
    min_cosine: Annotated[float, msgspec.Meta(ge=-1.0, le=1.0)] = 0.99
    min_top1: Fraction = 0.99
    threshold: Fraction = 0.3  # mask_iou: probability maps are binarised at this value
    min_mask_iou: Fraction = 0.95
    score_threshold: Fraction = 0.25  # det_f1: detections kept from this score on
    iou_threshold: Fraction = 0.45  # det_f1: NMS overlap
    score_margin: Fraction = 0.0  # det_f1: a matching box may score this much under the threshold
    min_det_f1: Fraction = 0.95
    holdout: Annotated[float, msgspec.Meta(gt=0.0, lt=1.0)] = 0.2
    # Mixed precision when all-INT8 fails: "auto" searches for nodes to keep in float.
    search: Literal["auto", "off"] = "auto"
    max_trials: Annotated[int, msgspec.Meta(ge=1, le=64)] = 8

    @property
    def metrics(self) -> tuple[str, ...]:
        return (self.metric,) if isinstance(self.metric, str) else tuple(self.metric)


class TensorRTConfig(Table, frozen=True):
    workspace: str = "1GiB"
    dla_core: Annotated[int, msgspec.Meta(ge=-1)] = -1
    legacy_calibrator: bool = False
    builder_optimization_level: Annotated[int, msgspec.Meta(ge=0, le=5)] = 3
    device: NonNegInt = 0  # GPU ordinal: the engine is built and loaded there
    # Strongly typed int8 (TensorRT 10+): the ops left unquantized run fp16 or fp32.
    float_parts: Literal["fp16", "fp32"] = "fp16"
    keep_fp32: list[str] = msgspec.field(default_factory=list)  # op types/node names; [] = defaults


class LlmConfig(Table, frozen=True):
    """A language model (a GGUF file): its KV cache, concurrency and request defaults."""

    context: Annotated[int, msgspec.Meta(ge=64, le=1 << 20)] = 2048  # tokens per slot
    # Concurrent sequences, decoded together in one llama.cpp context whose KV cache holds
    # ``context`` tokens for each slot plus ``prefix_cache_tokens``; sets the model's instances.
    slots: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1
    # Prompt tokens fed per decoding step while other sequences stream: the most a new prompt
    # delays the running ones.
    prefill_chunk: Annotated[int, msgspec.Meta(ge=16, le=4096)] = 256
    # The default system message: used when a chat request sends none, kept prefilled, and its
    # state saved to the engine cache so that a restart does not prefill it again.
    system_prompt: str = ""
    # KV cells kept for prompt prefixes (the system prompt, the chat so far) that a later request
    # reuses instead of prefilling; 0 keeps none.
    prefix_cache_tokens: NonNegInt = 2048
    # How many kept prefixes have their state written to the engine cache (the system prompt
    # first, then the most reused); 0 writes none.
    saved_prefixes: NonNegInt = 4
    max_tokens: PositiveInt = 256  # a request's default
    max_tokens_limit: PositiveInt = 1024  # the most a request may ask for
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] = 0.7
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.95
    stop: list[str] = msgspec.field(default_factory=list)
    # Warm-up before READY=1: each slot prefills a chat-templated prompt of about this many
    # tokens and decodes warmup_decode_tokens, the sizes a request uses.
    warmup_prompt_tokens: PositiveInt = 256
    warmup_decode_tokens: PositiveInt = 16


class ModelConfig(Table, frozen=True):
    path: str
    backend: Backend = "auto"
    precision: Precision = "fp32"
    priority: Annotated[int, msgspec.Meta(ge=0, le=100)] = 50
    preload: Literal["boot", "lazy"] = "boot"
    instances: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1
    max_batch: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1
    max_queue_delay_us: NonNegInt = 0
    # Batch sizes (rows) a batch is made of when the queue allows: Triton's preferred_batch_size.
    preferred_batch: list[PositiveInt] = msgspec.field(default_factory=list)
    queue_depth: PositiveInt = 64
    timeout_ms: NonNegInt = 0  # 0: the server's request_timeout_ms
    threads: NonNegInt = 0  # intra-op threads per instance; 0 = cores / instances
    profiles: dict[str, ShapeProfile] = msgspec.field(default_factory=dict)
    warmup: WarmupConfig = msgspec.field(default_factory=WarmupConfig)
    calibration: CalibrationConfig | None = None
    gate: GateConfig = msgspec.field(default_factory=GateConfig)
    tensorrt: TensorRTConfig = msgspec.field(default_factory=TensorRTConfig)
    llm: LlmConfig | None = None  # a GGUF model without this table gets LlmConfig()'s defaults


class Reshape(Table, frozen=True):
    """A tensor that clients see in another shape than the model file has (Triton's reshape);
    both without the batch dimension of a batched model, -1 for a variable size."""

    api: list[int]
    model: list[int]


class RepositoryModel(Table, frozen=True):
    """A model served from a Triton model repository: the name and version clients ask for and
    what edged made of its folder. Set by edged.repository, never read from a file."""

    model: str  # the name clients use
    version: str  # its version folder
    folder: str  # <repository>/<model>
    batched: bool = False  # max_batch_size > 0: every tensor's first dimension is the batch
    input_reshape: dict[str, Reshape] = msgspec.field(default_factory=dict)
    output_reshape: dict[str, Reshape] = msgspec.field(default_factory=dict)
    formats: dict[str, str] = msgspec.field(default_factory=dict)  # input → "FORMAT_NCHW", for clients
    # What edged serves otherwise than config.pbtxt asks, and why (a model.plan not served as is).
    note: str = ""
