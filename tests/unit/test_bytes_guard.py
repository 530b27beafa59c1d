"""BYTES tensors cost a Python object per element to read: a request for a model that takes no
BYTES input of that name is refused before any element is read, and a large BYTES body is read
off the event loop however its header spells the datatype."""

from __future__ import annotations

import asyncio
import struct
import threading

import orjson
import pytest

from edged.errors import InvalidInputError
from edged.wire import decode as protocol
from edged.wire import jsonchild
from edged.wire.decode import OFFLOAD_BYTES
from edged.wire.validate import Limits


def binary_bytes_body(count: int, datatype: str = "BYTES") -> tuple[bytes, int]:
    data = (struct.pack("<I", 1) + b"a") * count
    header = orjson.dumps(
        {"inputs": [{"name": "x", "shape": [count], "datatype": "@", "parameters": {"binary_data_size": len(data)}}]}
    ).replace(b'"@"', b'"' + datatype.encode() + b'"')
    return header + data, len(header)


def test_bytes_for_a_model_without_bytes_inputs_is_refused_before_it_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    read: list[int] = []
    monkeypatch.setattr(protocol, "deserialize_bytes", lambda *a, **k: read.append(1))
    body, header_len = binary_bytes_body(1000)
    limits = Limits(1, 1, "tiny", bytes_inputs=frozenset())
    with pytest.raises(InvalidInputError, match="model 'tiny' takes no BYTES input of that name"):
        protocol.parse_body(body, header_len, limits)
    assert read == []
    # A model whose input 'x' is BYTES reads it; an unknown model (None) is not judged here.
    for allowed in (frozenset({"x"}), None):
        monkeypatch.undo()
        parsed = protocol.parse_body(body, header_len, Limits(1, 1, "s", bytes_inputs=allowed))
        assert parsed.arrays["x"].shape == (1000,)


@pytest.mark.parametrize("datatype", ["BYTES", "\\u0042YTES", "B\\u0059TES"])
def test_a_large_bytes_body_is_read_off_the_loop_however_it_is_spelt(
    monkeypatch: pytest.MonkeyPatch, datatype: str
) -> None:
    threads: list[str] = []
    parse_body = protocol.parse_body

    def where(*args: object, **kwargs: object) -> protocol.ParsedBody:
        threads.append(threading.current_thread().name)
        return parse_body(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(jsonchild, "parse_body", where)
    body, header_len = binary_bytes_body(OFFLOAD_BYTES // 5 + 10, datatype)
    assert len(body) - header_len > OFFLOAD_BYTES
    req = asyncio.run(jsonchild.decode_infer_async(body, header_len))
    assert req.inputs["x"].shape == (OFFLOAD_BYTES // 5 + 10,)
    assert threads and threads[0] != threading.main_thread().name, "read on the event loop's thread"
