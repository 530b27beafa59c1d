"""Property tests of the MQTT request path without a broker (hypothesis, bounded examples):
any PUBLISH (payload kind, user properties, content type, raw property bytes) becomes a request
or an error with a stable 4xx-class code, never an exception; the linear property reader agrees
with paho's own; paho hands edged the raw property block."""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from paho.mqtt import _packet as paho_packet
from paho.mqtt.enums import MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edged.errors import BadRequestError, EdgedError
from edged.transports.mqtt import codec
from edged.transports.mqtt import props as mqtt_props
from edged.wire.decode import decode_infer

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MAX_BODY = 1 << 20

# Text MQTT can carry: no surrogates (not UTF-8) and no U+0000 (forbidden in MQTT strings).
mqtt_text = st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"), max_size=40)
special_keys = st.sampled_from(["dtype", "shape", "input", "output", "id", codec.HEADER_LENGTH])
special_values = st.one_of(
    st.sampled_from(["FP32", "float32", "INT8", "FP99", "1,16", "1x16", "[1, 16]", "[]", "-1", "0", "64", "1" * 30]),
    mqtt_text,
)
user_props = st.lists(st.one_of(st.tuples(special_keys, special_values), st.tuples(mqtt_text, mqtt_text)), max_size=12)
content_types = st.one_of(
    st.sampled_from(["", codec.JSON, codec.OCTET, "application/octet-stream; charset=x", "text/plain"]), mqtt_text
)


def infer_json(draw: st.DrawFn) -> bytes:
    shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=3))
    n = int(np.prod(shape)) if shape else 1
    doc: dict[str, Any] = {
        "inputs": [
            {
                "name": draw(st.sampled_from(["x", "y", ""])),
                "datatype": draw(st.sampled_from(["FP32", "INT64", "BOOL", "FP99"])),
                "shape": shape,
                "data": draw(st.lists(st.floats(allow_nan=False, width=32), min_size=n, max_size=n)),
            }
        ],
    }
    if draw(st.booleans()):
        doc["id"] = draw(st.one_of(mqtt_text, st.integers()))
    if draw(st.booleans()):
        doc["reply_to"] = draw(mqtt_text)
    if draw(st.booleans()):
        doc["outputs"] = draw(st.lists(st.fixed_dictionaries({"name": mqtt_text}), max_size=2))
    return json.dumps(doc).encode()


@st.composite
def payloads(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["json", "json+binary", "raw", "bytes", "text"]))
    if kind == "json":
        return infer_json(draw)
    if kind == "json+binary":
        return infer_json(draw) + draw(st.binary(max_size=64))
    if kind == "raw":
        return np.zeros(draw(st.integers(0, 32)), np.float32).tobytes()
    if kind == "text":
        return draw(mqtt_text).encode()
    return draw(st.binary(max_size=200))


@st.composite
def incoming(draw: st.DrawFn) -> codec.Incoming:
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    ctype = draw(content_types)
    if ctype:
        props.ContentType = ctype
    user = draw(user_props)
    if user:
        props.UserProperty = user
    if draw(st.booleans()):
        props.ResponseTopic = draw(mqtt_text) or "r"
    if draw(st.booleans()):
        props.CorrelationData = draw(st.binary(max_size=16))
    if draw(st.booleans()):
        props.MessageExpiryInterval = draw(st.integers(0, 2**32 - 1))
    packed = props.pack()
    block = packed[mqtt_props.vbi(packed, 0)[1] :]
    if draw(st.integers(0, 9)) == 0:  # now and then, bytes no broker would pass on
        block = draw(st.binary(max_size=40))
    return codec.Incoming("edged/d/models/m/infer", draw(payloads()), 1, props_raw=bytes(block))


@SETTINGS
@given(incoming())
def test_any_publish_is_a_request_or_a_client_error(inc: codec.Incoming) -> None:
    result = codec.read_request(inc, MAX_BODY)
    if isinstance(result, codec.Unreadable):
        assert isinstance(result.error, EdgedError)
        assert 400 <= result.error.http_status < 500, (result.error.code, result.error.message)
        assert result.error.code != "internal"
        reply = codec.error_reply(result.error, result.rid)
        assert json.loads(reply.payload)["code"] == result.error.code
    else:
        assert isinstance(result, codec.Decoded)
        if result.body is not None:  # JSON: decoded by the socket's decoder (Service.decode_infer)
            try:
                result.request = decode_infer(result.body, result.header_length)
            except EdgedError as e:
                assert 400 <= e.http_status < 500, (e.code, e.message)
                return
        assert result.raw_tensor is not None or result.request.inputs


@SETTINGS
@given(incoming())
def test_an_unknown_model_is_404_whatever_the_body(inc: codec.Incoming) -> None:
    from edged.errors import ModelNotFoundError

    result = codec.read_request(inc, MAX_BODY, ModelNotFoundError("unknown model 'm'"))
    assert isinstance(result, codec.Unreadable)
    assert result.error.code in ("model_not_found", "bad_request")  # bad_request: unreadable properties


@SETTINGS
@given(st.binary(max_size=300))
def test_property_reader_never_raises_anything_but_bad_request(block: bytes) -> None:
    try:
        mqtt_props.parse(block)
    except BadRequestError:
        pass


@SETTINGS
@given(
    ctype=mqtt_text,
    corr=st.binary(max_size=20),
    topic=mqtt_text,
    user=st.lists(st.tuples(mqtt_text, mqtt_text), max_size=10),
    expiry=st.integers(0, 2**32 - 1),
)
def test_property_reader_agrees_with_paho(
    ctype: str, corr: bytes, topic: str, user: list[tuple[str, str]], expiry: int
) -> None:
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    props.ContentType = ctype
    props.CorrelationData = corr
    if topic:
        props.ResponseTopic = topic
    if user:
        props.UserProperty = user
    props.MessageExpiryInterval = expiry
    packed = props.pack()
    theirs = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    theirs.unpack(packed)
    ours = mqtt_props.parse(packed[mqtt_props.vbi(packed, 0)[1] :])
    # paho's Properties declares no attributes (its __setattr__ stores them), hence the ignores.
    assert ours.content_type == theirs.ContentType  # type: ignore[attr-defined]
    assert ours.correlation == theirs.CorrelationData  # type: ignore[attr-defined]
    assert ours.response_topic == getattr(theirs, "ResponseTopic", "")
    assert ours.user == getattr(theirs, "UserProperty", [])
    assert ours.expiry_s == theirs.MessageExpiryInterval  # type: ignore[attr-defined]


def _publish_packet(topic: bytes, mid: int, props: bytes, payload: bytes) -> bytes:
    return struct.pack("!H", len(topic)) + topic + struct.pack("!H", mid) + props + payload


def test_paho_hands_over_the_raw_block_and_reads_it_on_demand() -> None:
    mqtt_props.install()
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    props.ResponseTopic = "reply/x"
    props.UserProperty = [("k", "v")] * 1000
    packed = props.pack()
    packet = _publish_packet(b"a/b", 9, packed, b"payload")
    result = paho_packet.decode_publish(0x32, packet, MQTTProtocolVersion.MQTTv5)
    got = result.properties
    assert isinstance(got, mqtt_props.LazyPublishProperties)
    assert got.raw == packed[mqtt_props.vbi(packed, 0)[1] :] and result.payload == b"payload"
    assert "_parsed" not in got.__dict__ or got.__dict__["_parsed"] is None  # not parsed yet
    assert got.ResponseTopic == "reply/x" and len(got.UserProperty) == 1000
    other = paho_packet.decode_suback(0x90, b"\x00\x01\x00\x00", MQTTProtocolVersion.MQTTv5)  # type: ignore[attr-defined]
    assert type(other.properties) is Properties  # other packets keep paho's class


def test_shape_and_header_length_are_parsed_strictly() -> None:
    for bad in ("1_6", "+16", "１６", "1" * 13, ",".join(["1"] * 33)):
        try:
            codec.parse_shape(bad)
        except BadRequestError:
            continue
        raise AssertionError(f"shape {bad!r} accepted")
    inc = codec.Incoming("t", b"{}", user={codec.HEADER_LENGTH: "-1"})
    try:
        codec.decode_json(inc)
    except BadRequestError as e:
        assert codec.HEADER_LENGTH in e.message
    else:
        raise AssertionError("a negative header length was accepted")
