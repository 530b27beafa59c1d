"""A Triton model repository served as it is.

``<repository>/<model>/config.pbtxt`` is read with protobuf's text format into Triton's own
``ModelConfig`` message (``edged/wire/proto``), checked field by field against what edged
honours (anything else set is refused by name), checked against the model file's own
signature, and turned into edged's ``ModelConfig``: one per served version, the latest under the
model's name and every other as ``NAME@VERSION``. ``<repository>/edged.toml`` adds edged's own
keys per model. ``load.load_config`` joins the result to the TOML's ``[models.*]``.

Modules: ``pbtxt`` (parsing), ``fields`` (what is honoured, what is refused and why),
``versions`` (version folders and policies), ``signature`` (a model file's tensors),
``tensors`` (config.pbtxt's tensors against them), ``translate`` (one model folder),
``plans`` (a prebuilt TensorRT plan and this device), ``overrides`` (edged.toml), ``load``.
"""
