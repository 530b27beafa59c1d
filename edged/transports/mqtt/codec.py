"""MQTT payloads: topics, requests (the HTTP infer JSON or one raw tensor) and replies.

Pure functions of bytes and properties, no client and no loop, so the wire format can be read
(and tested) in one place. docs/mqtt.md describes the same format for users.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edged.errors import BadRequestError, EdgedError, PayloadTooLargeError
from edged.transports.mqtt.props import PublishProps, parse
from edged.wire import tensors
from edged.wire.decode import NUMPY_TO_V2, OFFLOAD_BYTES, V2_TO_NUMPY, InferRequest, encode_infer
from edged.wire.jsondoc import load_json
from edged.wire.tensors import datatype_of

JSON = "application/json"
OCTET = "application/octet-stream"
# The HTTP header of the binary tensor data extension, reused as a user property so a JSON
# request may carry tensors as raw bytes after its JSON header, exactly as on the socket.
HEADER_LENGTH = "inference-header-content-length"

_JSON_OPTS = orjson.OPT_SERIALIZE_NUMPY


@dataclass
class Incoming:
    """What edged keeps of a PUBLISH. The MQTT 5 property block stays raw until
    :func:`read_request` parses it (off the event loop when it is large)."""

    topic: str
    payload: bytes
    qos: int = 0
    received: float = field(default_factory=time.monotonic)
    props_raw: bytes = b""
    response_topic: str = ""
    correlation: bytes | None = None
    content_type: str = ""
    user: dict[str, str] = field(default_factory=dict)
    expiry_s: int | None = None

    def apply(self, props: PublishProps) -> None:
        self.response_topic = props.response_topic
        self.correlation = props.correlation
        self.content_type = props.content_type
        self.user = dict(props.user)  # a repeated name: the last one wins
        self.expiry_s = props.expiry_s

    @property
    def size(self) -> int:
        """Bytes that decoding walks through: what decides whether it leaves the loop."""
        return len(self.payload) + len(self.props_raw)

    @property
    def deadline(self) -> float | None:
        """Monotonic time after which the sender no longer wants an answer."""
        return None if self.expiry_s is None else self.received + self.expiry_s

    def expired(self, now: float | None = None) -> bool:
        deadline = self.deadline
        return deadline is not None and (now if now is not None else time.monotonic()) > deadline

    @property
    def raw(self) -> bool:
        """One raw tensor. application/octet-stream with the header-length property is the
        binary tensor data extension instead, as on the socket."""
        return self.content_type.split(";")[0].strip().lower() == OCTET and HEADER_LENGTH not in self.user


@dataclass
class Decoded:
    """A request made ready for the service: ``input_name`` is None when a raw tensor leaves
    the name to the model (single-input models). A JSON request (``body`` set) is decoded by
    ``Service.decode_infer``, the decoder the socket uses, so both answer a fault alike."""

    request: InferRequest
    reply_to: str = ""
    raw: bool = False
    input_name: str | None = None
    raw_tensor: np.ndarray | None = None
    raw_output: str | None = None
    body: bytes | None = None
    header_length: int | None = None
    json_id: str = ""  # the 'id' an MQTT 3.1.1 client put beside its 'reply_to'


@dataclass
class Reply:
    payload: bytes
    content_type: str = JSON
    user: list[tuple[str, str]] = field(default_factory=list)


def model_from_topic(topic: str, prefix: str, device: str) -> str | None:
    """``{prefix}/{device}/models/{model}/infer`` or ``{prefix}/fleet/models/{model}/infer``."""
    if not topic.startswith(prefix + "/"):
        return None
    parts = topic[len(prefix) + 1 :].split("/")
    if len(parts) != 4 or parts[1] != "models" or parts[3] != "infer" or not parts[2]:
        return None
    return parts[2] if parts[0] in (device, "fleet") else None


# --- requests -----------------------------------------------------------------------------------


def parse_dtype(text: str) -> np.dtype[Any]:
    """``FP32`` (the protocol's name) or ``float32`` (numpy's), any case; then the wire rules."""
    t = text.strip()
    name = t.upper() if t.upper() in V2_TO_NUMPY else NUMPY_TO_V2.get(t.lower(), t)
    return tensors.parse_dtype(name, "user property 'dtype'")


_DIGITS = re.compile(r"[0-9]{1,12}")


def parse_shape(text: str) -> tuple[int, ...]:
    """``1,16``, ``1x16`` or the JSON list ``[1, 16]``; ASCII digits only; then the wire rules."""
    t = text.strip()
    try:
        dims = orjson.loads(t) if t.startswith("[") else [_dim(d) for d in t.replace("x", ",").split(",") if d.strip()]
    except (ValueError, orjson.JSONDecodeError):
        dims = None
    if not isinstance(dims, list) or not dims:
        raise BadRequestError(f"user property 'shape': expected integers such as '1,16', got {text[:80]!r}")
    return tensors.parse_shape(dims, "user property 'shape'")


def _dim(text: str) -> int:
    if not _DIGITS.fullmatch(text.strip()):
        raise ValueError(text)
    return int(text)


def decode_raw(msg: Incoming) -> Decoded:
    """One tensor as raw bytes in the device's byte order (little-endian on every Jetson and
    x86 machine), described by the user properties; a BYTES tensor length-prefixed, as in the
    binary tensor data extension."""
    if "dtype" not in msg.user or "shape" not in msg.user:
        raise BadRequestError("a raw tensor needs the user properties 'dtype' and 'shape'")
    dtype = parse_dtype(msg.user["dtype"])
    shape = parse_shape(msg.user["shape"])
    arr = tensors.from_bytes(msg.payload, dtype, shape, "the raw tensor")
    req = InferRequest(id=msg.user.get("id", ""))
    return Decoded(req, msg.response_topic, True, msg.user.get("input") or None, arr, msg.user.get("output") or None)


def reply_to_of(payload: bytes) -> tuple[str, str]:
    """The ``reply_to`` and ``id`` an MQTT 3.1.1 client puts in its JSON, even from a body that
    fails validation later, so the error still reaches it. ('', '') when unreadable. A large
    payload is read strictly: the reader that also takes NaN and Infinity is Python's, which holds
    the interpreter lock for the whole parse (0.28 s for 6.5 MB), so the loop would stall even
    with the parse on a worker thread."""
    try:
        doc = load_json(payload) if len(payload) <= OFFLOAD_BYTES else orjson.loads(payload)
    except (BadRequestError, orjson.JSONDecodeError):
        return "", ""
    if not isinstance(doc, dict):
        return "", ""
    reply_to, rid = doc.get("reply_to"), doc.get("id")
    return (reply_to if isinstance(reply_to, str) else "", "" if rid is None else str(rid))


def decode_json(msg: Incoming) -> Decoded:
    """The HTTP infer body, optionally with the binary tensor data extension."""
    header_length = None
    if HEADER_LENGTH in msg.user:
        text = msg.user[HEADER_LENGTH].strip()
        if not _DIGITS.fullmatch(text) or int(text) > len(msg.payload):
            raise BadRequestError(
                f"user property '{HEADER_LENGTH}' must be an integer from 0 to the payload's {len(msg.payload)} bytes"
            )
        header_length = int(text)
    reply_to, json_id = msg.response_topic, ""
    if not reply_to:  # read once, here (off the loop when large): an error later needs no second read
        reply_to, json_id = reply_to_of(msg.payload[:header_length] if header_length is not None else msg.payload)
    return Decoded(InferRequest(), reply_to, body=msg.payload, header_length=header_length, json_id=json_id)


def decode(msg: Incoming) -> Decoded:
    return decode_raw(msg) if msg.raw else decode_json(msg)


@dataclass
class Unreadable:
    """A request that cannot run, and where its error goes ('' when nowhere)."""

    error: EdgedError
    reply_to: str = ""
    rid: str = ""


def wire_error(exc: BaseException) -> EdgedError:
    """The one place where an MQTT failure becomes a wire error: edged's own errors keep their
    code (the same as on the socket for the same fault, edged/errors.py); anything else that
    escapes a decoder on hostile input is a bug, answered as 'internal' rather than raised."""
    if isinstance(exc, EdgedError):
        return exc
    return EdgedError(f"internal error: {type(exc).__name__}: {exc}")


def read_properties(inc: Incoming) -> Unreadable | None:
    """Apply the MQTT 5 property block, once (then it is dropped): None, or the error with no
    reply path (none is known without the properties)."""
    raw, inc.props_raw = inc.props_raw, b""
    if not raw:
        return None
    try:
        inc.apply(parse(raw))
    except Exception as e:
        return Unreadable(wire_error(e))
    return None


def read_request(inc: Incoming, max_body: int, refuse: EdgedError | None = None) -> Decoded | Unreadable:
    """Properties, then payload: a request ready to run, or the error and where to send it.
    Pure and linear in the message's size, so it may run in a worker thread. ``refuse``: an
    error decided before reading (an unknown model), answered like an unreadable body."""
    bad = read_properties(inc)
    if bad is not None:
        return bad
    err = refuse
    if err is None and len(inc.payload) > max_body:
        err = PayloadTooLargeError(f"payload of {len(inc.payload)} bytes exceeds the limit of {max_body}")
    if err is None:
        try:
            return decode(inc)
        except Exception as e:
            err = wire_error(e)
    return unreadable(inc, err, max_body)


def unreadable(inc: Incoming, err: EdgedError, max_body: int) -> Unreadable:
    """A request that failed before it ran, with where its error goes: the Response Topic, or
    the 'reply_to' and 'id' an MQTT 3.1.1 client put in its JSON."""
    reply_to, rid = inc.response_topic, inc.user.get("id", "")
    # Only an MQTT 3.1.1 request (no Response Topic) needs its JSON read for where to answer; an
    # MQTT 5 one is answered on its Response Topic with its Correlation Data.
    if not inc.raw and not reply_to and len(inc.payload) <= max_body:
        reply_to, json_rid = reply_to_of(inc.payload)
        rid = rid or json_rid
    return Unreadable(err, reply_to, rid)


def request_id(msg: Incoming) -> str:
    """For logs and the error reply before the body is parsed."""
    if "id" in msg.user:
        return msg.user["id"]
    if msg.correlation is not None:
        return msg.correlation.hex()[:32]
    return ""


# --- replies ------------------------------------------------------------------------------------


def ok_reply(model: str, dec: Decoded, results: dict[str, np.ndarray], version: str = "1") -> Reply:
    """``model`` and ``version``: as the client knows them (a repository model's served version)."""
    if dec.raw:
        return raw_reply(model, results, dec.raw_output)
    body, header_length = encode_infer(model, dec.request, results, version=version)
    if header_length is None:
        return Reply(body)
    return Reply(body, OCTET, [(HEADER_LENGTH, str(header_length))])


def raw_reply(model: str, results: dict[str, np.ndarray], wanted: str | None) -> Reply:
    """A raw request gets raw bytes back: what a sensor can use without a JSON parser. A model
    with several outputs answers with the one named by the 'output' user property, or with all
    of them in the binary tensor data format when none is named."""
    if wanted is None and len(results) > 1:
        body, header_length = encode_infer(model, InferRequest(binary_all=True), results)
        return Reply(body, OCTET, [(HEADER_LENGTH, str(header_length))])
    name = wanted if wanted is not None else next(iter(results))
    arr = results.get(name)
    if arr is None:
        raise BadRequestError(f"requested output '{name}' is not an output of '{model}'")
    return Reply(
        bytes(tensors.tensor_bytes(arr)),  # a BYTES output length-prefixed, as in the binary extension
        OCTET,
        [
            ("name", name),
            ("dtype", datatype_of(arr.dtype)),
            ("shape", ",".join(str(d) for d in arr.shape)),
        ],
    )


def error_reply(err: EdgedError, rid: str = "") -> Reply:
    doc: dict[str, Any] = err.to_dict()
    if rid:
        doc["id"] = rid  # an MQTT 3.1.1 client has nothing else to match the error with
    return Reply(orjson.dumps(doc), JSON, [("code", err.code)])


# --- MQTT 5 properties of a reply ---------------------------------------------------------------
# paho's Properties encoder looks every name up by string comparison: 25-80 us a reply on a small
# board, more than the tiny model's inference. A reply's properties are few and fixed in kind, so
# edged encodes them itself (MQTT 5.0 section 2.2.2) and hands paho the bytes.

_CONTENT_TYPE, _CORRELATION, _USER = 0x03, 0x09, 0x26


def _vbi(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n % 128, n // 128
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _utf8(text: str) -> bytes:
    raw = text.encode()
    return len(raw).to_bytes(2, "big") + raw


def pack_properties(content_type: str, correlation: bytes | None, user: list[tuple[str, str]]) -> bytes:
    """The property block of a PUBLISH: its length, then each property, in paho's order."""
    parts = [bytes([_CONTENT_TYPE]), _utf8(content_type)]
    if correlation is not None:
        parts += [bytes([_CORRELATION]), len(correlation).to_bytes(2, "big"), correlation]
    for key, value in user:
        parts += [bytes([_USER]), _utf8(key), _utf8(value)]
    body = b"".join(parts)
    return _vbi(len(body)) + body


class PackedProperties(Properties):
    """Properties already encoded: paho only ever calls ``pack()`` on a PUBLISH's properties."""

    _packed: bytes

    def __init__(self, packed: bytes) -> None:
        # Properties.__setattr__ accepts only property names; these bypass it on purpose.
        object.__setattr__(self, "packetType", PacketTypes.PUBLISH)
        object.__setattr__(self, "_packed", packed)

    def pack(self) -> bytes:
        return self._packed

    def __str__(self) -> str:  # paho's debug log prints a message's properties
        return f"<{len(self._packed)} bytes of properties>"


def model_state_doc(name: str, state: str, reason: str) -> bytes:
    return orjson.dumps({"model": name, "state": state, "reason": reason, "ts": round(time.time(), 3)})


def dumps(doc: Any) -> bytes:
    return orjson.dumps(doc, option=_JSON_OPTS)
