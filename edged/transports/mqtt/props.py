"""The properties of an incoming MQTT 5 PUBLISH, read in linear time and off the network path.

paho decodes a PUBLISH's properties while it reads the packet, on the event loop, and its
``Properties.unpack`` copies the rest of the packet (properties *and* payload) once per property:
quadratic. Measured: 10,000 user properties (70 KB) took 0.77 s, 50,000 (350 KB) 8.2 s, so a
1 MB property block outlives the broker keep-alive, the broker drops edged before the ack, and
redelivers the same message at every reconnect. So edged installs, for PUBLISH packets
only, a ``Properties`` that keeps the raw block (an O(1) slice: its length is the first field) and
parses it on first use with :func:`parse`, one pass over the bytes, where the transport chooses
(in a worker thread when the block is large). Other packet types keep paho's class.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from paho.mqtt import _packet as paho_packet
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import MQTTException, Properties

from edged.errors import BadRequestError

# MQTT 5.0 section 2.2.2.2: identifier -> (attribute, kind) for the properties of a PUBLISH.
_PUBLISH: dict[int, tuple[str, str]] = {
    0x01: ("PayloadFormatIndicator", "byte"),
    0x02: ("MessageExpiryInterval", "int32"),
    0x03: ("ContentType", "utf8"),
    0x08: ("ResponseTopic", "utf8"),
    0x09: ("CorrelationData", "binary"),
    0x0B: ("SubscriptionIdentifier", "vbi"),
    0x23: ("TopicAlias", "int16"),
    0x26: ("UserProperty", "pair"),
}
_MULTIPLE = {0x0B, 0x26}


@dataclass
class PublishProps:
    """What edged uses of a PUBLISH's properties, parsed."""

    response_topic: str = ""
    correlation: bytes | None = None
    content_type: str = ""
    user: list[tuple[str, str]] = field(default_factory=list)
    expiry_s: int | None = None
    values: dict[str, Any] = field(default_factory=dict)  # every property by paho's attribute name


def vbi(buf: bytes, pos: int) -> tuple[int, int]:
    """A variable byte integer at ``pos``: (value, position after it)."""
    value, mult = 0, 1
    for i in range(4):
        if pos + i >= len(buf):
            raise BadRequestError("malformed MQTT properties: truncated variable byte integer")
        byte = buf[pos + i]
        value += (byte & 0x7F) * mult
        if not byte & 0x80:
            return value, pos + i + 1
        mult *= 128
    raise BadRequestError("malformed MQTT properties: variable byte integer over 4 bytes")


def _take(buf: bytes, pos: int, n: int) -> bytes:
    if pos + n > len(buf):
        raise BadRequestError("malformed MQTT properties: a value runs past the property block")
    return buf[pos : pos + n]


def _binary(buf: bytes, pos: int) -> tuple[bytes, int]:
    n = int.from_bytes(_take(buf, pos, 2), "big")
    return _take(buf, pos + 2, n), pos + 2 + n


def _utf8(buf: bytes, pos: int) -> tuple[str, int]:
    raw, pos = _binary(buf, pos)
    try:
        text = raw.decode("utf-8")  # strict: rejects surrogates (MQTT-1.5.4-1)
    except UnicodeDecodeError:
        raise BadRequestError("malformed MQTT properties: a string is not valid UTF-8") from None
    if "\x00" in text:
        raise BadRequestError("malformed MQTT properties: a string holds U+0000")
    return text, pos


def _value(kind: str, buf: bytes, pos: int) -> tuple[Any, int]:
    if kind == "byte":
        return _take(buf, pos, 1)[0], pos + 1
    if kind in ("int16", "int32"):
        n = 2 if kind == "int16" else 4
        return int.from_bytes(_take(buf, pos, n), "big"), pos + n
    if kind == "vbi":
        return vbi(buf, pos)
    if kind == "binary":
        return _binary(buf, pos)
    if kind == "utf8":
        return _utf8(buf, pos)
    key, pos = _utf8(buf, pos)
    value, pos = _utf8(buf, pos)
    return (key, value), pos


def parse(block: bytes) -> PublishProps:
    """The property block of a PUBLISH without its length prefix; one pass, O(len(block)).
    Malformed input is a BadRequestError (the broker checked it, so this is a broken broker)."""
    out = PublishProps()
    values = out.values
    pos = 0
    while pos < len(block):
        ident, pos = vbi(block, pos)
        spec = _PUBLISH.get(ident)
        if spec is None:
            raise BadRequestError(f"malformed MQTT properties: identifier 0x{ident:02x} is not one of a PUBLISH")
        name, kind = spec
        value, pos = _value(kind, block, pos)
        if ident in _MULTIPLE:
            values.setdefault(name, []).append(value)
        elif name in values:
            raise BadRequestError(f"malformed MQTT properties: {name} given twice")
        else:
            values[name] = value
    out.response_topic = values.get("ResponseTopic", "")
    out.correlation = values.get("CorrelationData")
    out.content_type = values.get("ContentType", "")
    out.user = values.get("UserProperty", [])
    out.expiry_s = values.get("MessageExpiryInterval")
    return out


class LazyPublishProperties(Properties):
    """paho's Properties for an incoming PUBLISH: ``unpack`` keeps the raw block; attributes
    (``ResponseTopic``...) are parsed by :func:`parse` on first access, so code that reads them
    the paho way keeps working."""

    raw: bytes

    def __init__(self) -> None:
        super().__init__(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
        object.__setattr__(self, "raw", b"")
        object.__setattr__(self, "_parsed", None)

    def unpack(self, buffer: bytes | bytearray) -> tuple[LazyPublishProperties, int]:
        try:
            length, start = vbi(bytes(buffer[:4]), 0)
        except BadRequestError as e:
            raise MQTTException(e.message) from None
        if start + length > len(buffer):
            raise MQTTException("malformed MQTT properties: the block runs past the packet")
        object.__setattr__(self, "raw", bytes(buffer[start : start + length]))
        return self, start + length

    def parsed(self) -> PublishProps:
        props: PublishProps | None = self.__dict__.get("_parsed")
        if props is None:
            props = parse(self.raw)
            object.__setattr__(self, "_parsed", props)
        return props

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "raw":
            raise AttributeError(name)
        values = self.parsed().values
        if name in values:
            return values[name]
        raise AttributeError(name)

    def __str__(self) -> str:  # paho's debug log prints a message's properties
        return f"<{len(self.raw)} bytes of properties>"


def _properties(packet_type: int) -> Properties:
    if packet_type == PacketTypes.PUBLISH:
        return LazyPublishProperties()
    return Properties(packet_type)  # type: ignore[no-untyped-call]


_install_lock = threading.Lock()


def install() -> None:
    """Make paho decode incoming PUBLISH properties lazily (idempotent). paho's packet decoder
    names ``Properties`` as a module global; nothing else in it changes. A unit test checks that
    a PUBLISH decoded by paho carries a :class:`LazyPublishProperties`, so a paho release that
    moves this fails the suite instead of silently restoring the quadratic path."""
    with _install_lock:
        if getattr(paho_packet, "Properties", None) is not _properties:
            paho_packet.Properties = _properties  # type: ignore[attr-defined,assignment,misc]
