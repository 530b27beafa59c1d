"""The MQTT wire format without a broker: reply properties byte for byte against paho's own
encoder, and the parsing of topics and raw-tensor properties. (No broker, no daemon: these are
unit tests kept next to the MQTT tests they support.)"""

from __future__ import annotations

import numpy as np
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edged.errors import BadRequestError
from edged.transports.mqtt import codec


@pytest.mark.parametrize(
    ("ctype", "corr", "user"),
    [
        ("application/json", b"c-1", [("device", "jetson-07")]),
        ("application/octet-stream", None, [("device", "d"), ("dtype", "FP32"), ("shape", "1,4")]),
        ("application/json", bytes(range(256)) * 2, [("é", "ü" * 70)]),  # a two-byte length, a long VBI
    ],
)
def test_packed_properties_match_paho(ctype: str, corr: bytes | None, user: list[tuple[str, str]]) -> None:
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    props.ContentType = ctype
    if corr is not None:
        props.CorrelationData = corr
    props.UserProperty = user
    packed = codec.pack_properties(ctype, corr, user)
    assert packed == props.pack()
    decoded = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    decoded.unpack(packed)
    assert (getattr(decoded, "ContentType", None), getattr(decoded, "UserProperty", None)) == (ctype, user)
    assert codec.PackedProperties(packed).pack() is packed


def test_topics() -> None:
    assert codec.model_from_topic("plant/a/edged/dev/models/m1/infer", "plant/a/edged", "dev") == "m1"
    assert codec.model_from_topic("edged/fleet/models/m1/infer", "edged", "dev") == "m1"
    for topic in (
        "edged/other/models/m1/infer",
        "edged/dev/models/m1/state",
        "edged/dev/models//infer",
        "edgedx/dev/models/m1/infer",
        "edged/dev/models/m1/infer/x",
    ):
        assert codec.model_from_topic(topic, "edged", "dev") is None, topic


@pytest.mark.parametrize(
    ("text", "dtype"),
    [
        ("FP32", "float32"),
        ("fp16", "float16"),
        ("float32", "float32"),
        ("UINT8", "uint8"),
        (" int64 ", "int64"),
        ("BOOL", "bool"),
    ],
)
def test_dtype_names(text: str, dtype: str) -> None:
    assert codec.parse_dtype(text) == np.dtype(dtype)


@pytest.mark.parametrize(
    ("text", "shape"), [("1,16", (1, 16)), ("1x3x64x64", (1, 3, 64, 64)), ("[2, 16]", (2, 16)), (" 4 ", (4,))]
)
def test_shapes(text: str, shape: tuple[int, ...]) -> None:
    assert codec.parse_shape(text) == shape


@pytest.mark.parametrize("text", ["", "one", "1,-2", "[1.5]", "[true]", "[]", '{"a": 1}'])
def test_bad_shapes(text: str) -> None:
    with pytest.raises(BadRequestError, match="shape"):
        codec.parse_shape(text)


def test_raw_reply_names_dtype_and_shape() -> None:
    out = np.arange(8, dtype=np.float32).reshape(2, 4)
    reply = codec.raw_reply("m", {"probs": out}, None)
    assert reply.content_type == codec.OCTET
    assert dict(reply.user) == {"name": "probs", "dtype": "FP32", "shape": "2,4"}
    assert np.array_equal(np.frombuffer(reply.payload, np.float32).reshape(2, 4), out)
    both = codec.raw_reply("m", {"a": out, "b": out[:1]}, None)  # several outputs: binary extension
    header_length = int(dict(both.user)[codec.HEADER_LENGTH])
    assert len(both.payload) == header_length + out.nbytes + out[:1].nbytes
