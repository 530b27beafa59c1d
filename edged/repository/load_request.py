"""A repository load request's parameters (Triton's model repository extension, tritonclient's
``load_model(name, config=..., files=...)``): a ``config`` that takes the place of the model's
config.pbtxt, and ``file:PATH`` entries that take the place of its folder.

Both transports hand their parameters here as plain values (HTTP: JSON with each file
base64-encoded; gRPC: ModelRepositoryParameter's string or bytes), so the checks and their
messages are the same on both. The config is JSON of Triton's ModelConfig read with protobuf's
json_format, never by hand: a field the message lacks or a value of the wrong type is the
parser's error.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from google.protobuf import json_format

from edged.errors import BadRequestError, PayloadTooLargeError, RepositoryPollError
from edged.repository.pbtxt import MAX_BYTES
from edged.wire.proto import model_config_pb2

MAX_FILES = 64  # a model's folder: a few version folders of a model file and its external data
MAX_DEPTH = 8  # path components of one file
NAME_MAX = 255  # bytes in one path component (Linux's NAME_MAX)
CONFIG_TEXT = "config.pbtxt"


@dataclass(frozen=True)
class LoadRequest:
    config: str | None = None  # ModelConfig as JSON, as the request gave it
    files: Mapping[str, bytes] = field(default_factory=dict)  # path in the model's folder → contents

    @property
    def given(self) -> bool:
        return self.config is not None or bool(self.files)


PLAIN = LoadRequest()


def from_parameters(name: str, params: Mapping[str, object]) -> LoadRequest:
    """The request's parameters, each value decoded by its transport: the config a str, each
    file bytes. Other parameters are Triton's to other ends and pass unread, as in Triton."""
    config = params.get("config")
    if config is not None and not isinstance(config, str):
        raise BadRequestError(f"failed to load '{name}': config: expected ModelConfig as a JSON string")
    files: dict[str, bytes] = {}
    for key, value in params.items():
        if not key.startswith("file:"):
            continue
        if not isinstance(value, bytes):
            raise BadRequestError(f"failed to load '{name}': {_shown(key)}: expected the file's bytes")
        files[key[len("file:") :]] = value
    if files and config is None:
        raise BadRequestError(
            f"failed to load '{name}': file: parameters need a config beside them "
            "(the files take the place of the model's folder, its config.pbtxt included)"
        )
    if len(files) > MAX_FILES:
        raise PayloadTooLargeError(f"failed to load '{name}': {len(files)} files; a load takes at most {MAX_FILES}")
    for path in files:
        check_path(name, path)
    return LoadRequest(config, files)


def check_path(name: str, path: str) -> None:
    """A file's path inside the model's folder: relative, at most MAX_DEPTH plain names of at
    most NAME_MAX bytes each (the model's own file names are checked where they are read)."""
    parts = path.split("/")
    why = ""
    if not path or path.startswith("/"):
        why = "not a relative path"
    elif "\0" in path or "\\" in path:
        why = "a NUL or a backslash in the path"
    elif any(p in ("", ".", "..") for p in parts):
        why = "an empty, '.' or '..' component in the path"
    elif len(parts) > MAX_DEPTH:
        why = f"{len(parts)} components; at most {MAX_DEPTH}"
    elif any(len(p.encode("utf-8", "surrogatepass")) > NAME_MAX for p in parts):
        why = f"a component longer than {NAME_MAX} bytes"
    elif path == CONFIG_TEXT:
        raise BadRequestError(
            f"failed to load '{name}': file:{CONFIG_TEXT}: the configuration is the request's config parameter"
        )
    if why:
        raise RepositoryPollError(
            f"failed to load '{name}': failed to poll from model repository: {_shown('file:' + path)}: {why}"
        )


def parse_config(name: str, text: str) -> model_config_pb2.ModelConfig:
    """The request's config as Triton's ModelConfig (JSON, protobuf's json_format)."""
    if len(text) > MAX_BYTES:
        raise PayloadTooLargeError(f"failed to load '{name}': config: more than {MAX_BYTES} bytes")
    message = model_config_pb2.ModelConfig()
    try:
        json_format.Parse(text, message)
    except json_format.ParseError as e:
        # Its first line says what is wrong; the rest lists every field the message has.
        raise BadRequestError(f"failed to load '{name}': config: {str(e).splitlines()[0]}") from None
    return message


def _shown(text: str) -> str:
    return text if len(text) <= 80 else f"{text[:60]}...({len(text)} characters)"
