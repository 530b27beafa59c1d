"""The models Triton's example clients ask for, as a Triton model repository of ONNX models built
with the onnx helper API (tests/integration/test_triton_examples.py serves it).

Every model takes ``[batch, 16]`` tensors (``max_batch_size: 8``, ``dims: [ 16 ]``), as Triton's
own ``simple`` family does:

  * ``simple``: INT32 INPUT0, INPUT1 → OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1;
  * ``simple_int8``, ``simple_fp32``, ``simple_int64``: the same in INT8, FP32 and INT64;
  * ``simple_string``: the same on BYTES tensors holding decimal integers, answered as decimal
    strings (ONNX ``Cast`` parses and prints them);
  * ``simple_identity``: BYTES INPUT0 → OUTPUT0 unchanged;
  * ``simple_flat``: INT32 ``[-1]`` INPUT0, INPUT1 → sum and difference, unbatched;
  * ``simple_fp64`` (``eighth=True`` only): the arithmetic in FP64.

The model-control examples count the repository index: ``simple_http_model_control`` expects
seven models, ``simple_grpc_model_control`` eight.
"""

from __future__ import annotations

from pathlib import Path

from edged.tools.demo import save_graph

# ONNX element type, Triton data type, for the arithmetic models.
ARITHMETIC = {
    "simple": ("INT32", "TYPE_INT32"),
    "simple_int8": ("INT8", "TYPE_INT8"),
    "simple_fp32": ("FLOAT", "TYPE_FP32"),
    "simple_int64": ("INT64", "TYPE_INT64"),
}


def _pbtxt(dtype: str, inputs: list[str], outputs: list[str], batched: bool = True) -> str:
    dims = "[ 16 ]" if batched else "[ -1 ]"
    tensors = [f'input [ {{ name: "{n}" data_type: {dtype} dims: {dims} }} ]' for n in inputs]
    tensors += [f'output [ {{ name: "{n}" data_type: {dtype} dims: {dims} }} ]' for n in outputs]
    head = f'platform: "onnxruntime_onnx"\nmax_batch_size: {8 if batched else 0}\n'
    return head + "\n".join(tensors) + "\n"


def _sum_and_difference(path: Path, elem: str, shape: list[int | str], through: str | None = None) -> Path:
    """INPUT0, INPUT1 → OUTPUT0 = sum, OUTPUT1 = difference; ``through``: the element type the
    arithmetic runs in, the inputs cast to it and the answers cast back (strings parse as it)."""
    from onnx import TensorProto, helper

    kind = getattr(TensorProto, elem)
    nodes, a, b, s, d = [], "INPUT0", "INPUT1", "OUTPUT0", "OUTPUT1"
    if through is not None:
        inner = getattr(TensorProto, through)
        nodes += [helper.make_node("Cast", ["INPUT0"], ["a"], to=inner)]
        nodes += [helper.make_node("Cast", ["INPUT1"], ["b"], to=inner)]
        a, b, s, d = "a", "b", "s", "d"
    nodes += [helper.make_node("Add", [a, b], [s]), helper.make_node("Sub", [a, b], [d])]
    if through is not None:
        nodes += [helper.make_node("Cast", ["s"], ["OUTPUT0"], to=kind)]
        nodes += [helper.make_node("Cast", ["d"], ["OUTPUT1"], to=kind)]
    graph = helper.make_graph(
        nodes,
        path.parent.parent.name,
        [helper.make_tensor_value_info(n, kind, shape) for n in ("INPUT0", "INPUT1")],
        [helper.make_tensor_value_info(n, kind, shape) for n in ("OUTPUT0", "OUTPUT1")],
    )
    return save_graph(graph, path)


def _identity(path: Path) -> Path:
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])],
        "simple_identity",
        [helper.make_tensor_value_info("INPUT0", TensorProto.STRING, ["N", 16])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.STRING, ["N", 16])],
    )
    return save_graph(graph, path)


def _folder(root: Path, name: str, pbtxt: str) -> Path:
    (root / name / "1").mkdir(parents=True, exist_ok=True)
    (root / name / "config.pbtxt").write_text(pbtxt)
    return root / name / "1" / "model.onnx"


def example_repository(root: Path, eighth: bool = False) -> Path:
    """``root`` as a Triton model repository of the seven models above (eight with ``eighth``)."""
    pair, sums = ["INPUT0", "INPUT1"], ["OUTPUT0", "OUTPUT1"]
    arithmetic = ARITHMETIC | ({"simple_fp64": ("DOUBLE", "TYPE_FP64")} if eighth else {})
    for name, (elem, dtype) in arithmetic.items():
        # ONNX Runtime's CPU Add and Sub have no INT8 kernel: the arithmetic runs in INT32 and
        # wraps back to INT8 as Triton's INT8 model's does.
        through = "INT32" if elem == "INT8" else None
        _sum_and_difference(_folder(root, name, _pbtxt(dtype, pair, sums)), elem, ["N", 16], through)
    strings = _folder(root, "simple_string", _pbtxt("TYPE_STRING", pair, sums))
    _sum_and_difference(strings, "STRING", ["N", 16], "INT32")
    _identity(_folder(root, "simple_identity", _pbtxt("TYPE_STRING", ["INPUT0"], ["OUTPUT0"])))
    _sum_and_difference(_folder(root, "simple_flat", _pbtxt("TYPE_INT32", pair, sums, batched=False)), "INT32", ["L"])
    return root
