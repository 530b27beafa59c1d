"""A small ONNX model with string (BYTES) tensors, for the BYTES tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edged.tools.demo import save_graph


def make_string_model(path: Path) -> Path:
    """text [N] string → shout [N] string (each element with "!" appended, StringConcat);
    x [N, 2] FP32 → y = 2x; rows [N] INT64, every element N: the batch ONNX Runtime ran."""
    from onnx import TensorProto, helper

    nodes = [
        helper.make_node("StringConcat", ["text", "bang"], ["shout"]),
        helper.make_node("Add", ["x", "x"], ["y"]),
        helper.make_node("Shape", ["text"], ["n"]),
        helper.make_node("Expand", ["n", "n"], ["rows"]),
    ]
    graph = helper.make_graph(
        nodes,
        "strings",
        [
            helper.make_tensor_value_info("text", TensorProto.STRING, ["N"]),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2]),
        ],
        [
            helper.make_tensor_value_info("shout", TensorProto.STRING, ["N"]),
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2]),
            helper.make_tensor_value_info("rows", TensorProto.INT64, ["N"]),
        ],
        [helper.make_tensor("bang", TensorProto.STRING, [1], np.array([b"!"], dtype=object))],
    )
    return save_graph(graph, path, opset=20)  # StringConcat is opset 20
