"""config.pbtxt read with protobuf's text format into Triton's ModelConfig message.

The text format is protobuf's own (``google.protobuf.text_format``), never parsed by hand: a
field that Triton's message does not have, a value of the wrong type or a syntax error is the
parser's error, given with the file and the line it names.
"""

from __future__ import annotations

from pathlib import Path

from google.protobuf import text_format

from edged.errors import ConfigError
from edged.wire.proto import model_config_pb2

ModelConfigProto = model_config_pb2.ModelConfig

# A config.pbtxt is a few kilobytes; anything near this is not one (and is not read whole).
MAX_BYTES = 1 << 20


def parse_text(text: str, where: str) -> model_config_pb2.ModelConfig:
    """``text`` as a ModelConfig; ``where`` names it in errors."""
    message = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(text, message)
    except text_format.ParseError as e:
        # The parser's message starts with "line:column : ...": the file's name goes first.
        raise ConfigError(f"{where}:{e}") from None
    return message


def read(path: Path) -> model_config_pb2.ModelConfig:
    """The config.pbtxt at ``path``; a missing file is an empty configuration (Triton completes
    one from the model file, as edged does)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return model_config_pb2.ModelConfig()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    if len(data) > MAX_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_BYTES} bytes, not a model configuration")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text: {e}") from None
    return parse_text(text, str(path))
