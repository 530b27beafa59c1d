"""The Q/DQ model's graph, read and edited: node names the quantizer can exclude by, the Q/DQ pair
on a graph output taken off, what was quantized, and TensorRT's rules checked (qdq.py writes the
model with ONNX Runtime's quantizer; these are the steps around it)."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnx
from onnx import numpy_helper

# Per-channel Q/DQ needs the ``axis`` attribute of opset 13.
MIN_OPSET = 13


def name_nodes(path: Path) -> None:
    """Give unnamed nodes a stable name: ``nodes_to_exclude`` can only name named nodes."""
    model = onnx.load(str(path))
    taken = {n.name for n in model.graph.node if n.name}
    changed = False
    for i, node in enumerate(model.graph.node):
        if not node.name:
            name = f"{node.op_type}_{i}"
            while name in taken:
                name += "_"
            node.name = name
            taken.add(name)
            changed = True
    if changed:
        onnx.save(model, str(path))


def float_graph_outputs(model: onnx.ModelProto) -> int:
    """Drop the Q/DQ pair ORT puts on a graph output (a classifier's last Gemm): it rounds the
    model's answer to 256 levels and buys no speed, since the last op's result is dequantized
    anyway. Returns how many outputs were freed."""
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    uses = collections.Counter(i for n in graph.node for i in n.input)
    freed = 0
    for out in graph.output:
        dq = producer.get(out.name)
        if dq is None or dq.op_type != "DequantizeLinear" or uses[dq.input[0]] != 1:
            continue
        q = producer.get(dq.input[0])
        if q is None or q.op_type != "QuantizeLinear":
            continue
        source = producer.get(q.input[0])
        if source is None or uses[q.input[0]] != 1:
            continue  # a graph input passed straight through, or a tensor others read too
        source.output[list(source.output).index(q.input[0])] = out.name
        graph.node.remove(q)
        graph.node.remove(dq)
        freed += 1
    if freed:
        used = {i for n in graph.node for i in n.input}
        dead = [i for i in graph.initializer if i.name not in used]
        for init in dead:
            graph.initializer.remove(init)
    return freed


def qdq_nodes_summary(model: onnx.ModelProto, ops: Sequence[str]) -> dict[str, Any]:
    """Node counts, and which of the requested op types read a dequantized input (quantized)
    or not (left in float: excluded, or no range to quantize them with)."""
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    counts = collections.Counter(n.op_type for n in graph.node)
    quantized: collections.Counter[str] = collections.Counter()
    unquantized: collections.Counter[str] = collections.Counter()
    for n in graph.node:
        if n.op_type in ops and n.input:
            src = producer.get(n.input[0])
            fed = src is not None and src.op_type == "DequantizeLinear"
            (quantized if fed else unquantized)[n.op_type] += 1
    return {
        "quantize_nodes": counts["QuantizeLinear"],
        "dequantize_nodes": counts["DequantizeLinear"],
        "quantized_ops": dict(sorted(quantized.items())),
        "unquantized_ops": dict(sorted(unquantized.items())),
    }


def check_qdq(model: onnx.ModelProto) -> list[str]:
    """What in a Q/DQ model TensorRT's explicit quantization would refuse: opset below 13,
    non-int8 or non-zero zero points, INT32 (bias) dequantization. Empty when it is fine."""
    problems: list[str] = []
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < MIN_OPSET:
        problems.append(f"opset {opset} < {MIN_OPSET}")
    inits = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            continue
        zp = inits.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        if zp is None:
            problems.append(f"{node.name}: no int8 zero point (defaults to uint8)")
            continue
        if zp.data_type != onnx.TensorProto.INT8:
            problems.append(f"{node.name}: zero point is {onnx.TensorProto.DataType.Name(zp.data_type)}, not INT8")
        elif numpy_helper.to_array(zp).any():
            problems.append(f"{node.name}: non-zero zero point")
    return problems
