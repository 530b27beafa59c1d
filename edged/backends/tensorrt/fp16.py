"""A Q/DQ model's float parts in FP16, for strongly typed INT8 builds (TensorRT 10.x and 11).

A strongly typed network runs every tensor in the type the model gives it, so the ops the Q/DQ
recipe leaves unquantized (activations such as hard-swish, squeeze-excite, Resize, the head, and
the nodes the mixed-precision search excluded from INT8) would run FP32, where TensorRT 8.x's FP16
flag ran them FP16. This pass does what NVIDIA's Model Optimizer does for the same reason: it
moves the model to opset 19 (whose QuantizeLinear/DequantizeLinear take FP16 scales, so a
DequantizeLinear hands FP16 straight to the layer it feeds and the INT8 fusion stays intact) and
converts every float tensor to FP16, except:

- the graph's inputs and outputs (a Cast at each boundary keeps the model's interface);
- ops kept FP32: by default the numerically sensitive ones (exponentials, logs, powers, roots,
  reductions, normalisations, Softmax) and a Sigmoid/HardSigmoid that produces a graph output
  (a final probability map); ``keep_fp32`` (op types or node names) replaces that default;
- inputs whose schema takes float32 only (Resize's scales), node outputs whose type an attribute
  decides (Constant, ConstantOfShape), ops outside the default domain or with subgraphs;
- Q/DQ nodes whose activation scales, and ops whose float weights, FP16 cannot hold (below
  2**-14 or above 65504): they stay FP32 rather than lose their values.

A weight's per-channel scale below FP16's smallest normal number (2**-14) is raised to it first
(``raise_weight_scales``): such a channel's weights are all below 127 * 2**-14 (about 0.008) in
magnitude, so at the raised scale they keep their value to within 2**-15 and the smallest of them
round to zero, which in a layer whose other channels are a thousand times larger is what they
amount to anyway. Kept at their own scale, the weight's Q/DQ pair would stay FP32 and need a Cast
before its layer, and TensorRT runs a layer INT8 only with the DequantizeLinear directly before
it: the demo detector lost INT8 on 9 of its 64 convolutions that way.

Casts are inserted wherever an FP16 and an FP32 part meet. onnxconverter-common's converter was
the well-kept candidate; it has no notion of Q/DQ (it would put a Cast between each
DequantizeLinear and its layer, which blocks TensorRT's INT8 fusion, or convert scales without
raising the opset), so the project keeps this pass. The accuracy gate judges the engine built
from its output like any other.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edged.errors import BuildError

FLOAT, FLOAT16 = 1, 10  # onnx.TensorProto.FLOAT / FLOAT16
FP16_OPSET = 19
FP16_MIN_NORMAL, FP16_MAX = 2.0**-14, 65504.0
SENSITIVE_OPS = frozenset(
    {
        "Exp",
        "Log",
        "Pow",
        "Sqrt",
        "Reciprocal",
        "Softmax",
        "LogSoftmax",
        "ReduceSum",
        "ReduceMean",
        "ReduceSumSquare",
        "ReduceL2",
        "ReduceLogSumExp",
        "LayerNormalization",
        "InstanceNormalization",
        "GroupNormalization",
        "Erf",
    }
)
FINAL_OPS = frozenset({"Sigmoid", "HardSigmoid", "Softmax", "LogSoftmax"})
LISTED = 20


def _kept(graph: Any, keep: Sequence[str]) -> set[str]:
    """Names (or, for unnamed nodes, ids) of the nodes that stay FP32 by policy."""
    outputs = {o.name for o in graph.output}
    kept = set()
    for i, node in enumerate(graph.node):
        key = node.name or f"#{i}"
        if keep:
            hit = node.op_type in keep or (node.name and node.name in keep)
        else:
            hit = node.op_type in SENSITIVE_OPS or (node.op_type in FINAL_OPS and bool(set(node.output) & outputs))
        if hit:
            kept.add(key)
    return kept


def _formal(params: Any, index: int) -> Any:
    if index < len(params):
        return params[index]
    last = params[-1] if params else None
    variadic = last is not None and last.option == last.option.Variadic
    return last if variadic else None


def _fp16_allowed(schema: Any, param: Any) -> bool:
    if param is None:
        return False
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    return "tensor(float16)" in allowed.get(param.type_str, {param.type_str})


def _representable(arr: np.ndarray, scale: bool) -> bool:
    """Weights only need to stay below FP16's maximum (tiny ones may flush to zero, as FP16
    training does); a Q/DQ scale must also stay a normal FP16 number, or it divides by zero."""
    mag = np.abs(arr[np.isfinite(arr) & (arr != 0)])
    if not mag.size:
        return True
    return float(mag.max()) <= FP16_MAX and (not scale or float(mag.min()) >= FP16_MIN_NORMAL)


class _Pass:
    def __init__(self, model: Any, keep: Sequence[str]) -> None:
        import onnx

        self.onnx = onnx
        self.model = model
        self.graph = model.graph
        self.opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
        g = self.graph
        self.types: dict[str, int] = {
            v.name: v.type.tensor_type.elem_type for v in [*g.input, *g.output, *g.value_info]
        }
        self.inits = {i.name: i for i in g.initializer}
        self.types.update({name: t.data_type for name, t in self.inits.items()})
        graph_inputs = {i.name for i in g.input}
        self.now = {name: t for name, t in self.types.items() if name in self.inits or name in graph_inputs}
        self.kept = _kept(g, keep)
        self.casts: dict[tuple[str, int], str] = {}
        self.new_inits: dict[str, str] = {}
        self.nodes: list[Any] = []
        self.fp16_ops: collections.Counter[str] = collections.Counter()
        self.fp32_ops: collections.Counter[str] = collections.Counter()
        self.kept_named: list[str] = []
        self.fp16_names: set[str] = set()

    def _schema(self, node: Any) -> Any:
        if node.domain not in ("", "ai.onnx") or any(a.type in (5, 10) for a in node.attribute):  # GRAPH(S)
            return None
        try:
            return self.onnx.defs.get_schema(node.op_type, self.opset, "")
        except Exception:  # an op this onnx does not know: leave it as it is
            return None

    def _weights_fit(self, node: Any) -> bool:
        from onnx import numpy_helper

        qdq = node.op_type in ("QuantizeLinear", "DequantizeLinear")
        for i, name in enumerate(node.input):
            init = self.inits.get(name)
            if init is None or init.data_type != FLOAT:
                continue
            if not _representable(numpy_helper.to_array(init), scale=qdq and i == 1):
                return False
        return True

    def _cast(self, name: str, to: int) -> str:
        key = (name, to)
        if key not in self.casts:
            if name in self.inits and to == FLOAT16:  # a weight: store it converted, no Cast node
                from onnx import numpy_helper

                new = f"{name}__fp16"
                arr = numpy_helper.to_array(self.inits[name]).astype(np.float16)
                self.graph.initializer.append(numpy_helper.from_array(arr, new))
            else:
                new = f"{name}__{'fp16' if to == FLOAT16 else 'fp32'}"
                self.nodes.append(self.onnx.helper.make_node("Cast", [name], [new], to=to, name=f"cast_{new}"))
            self.casts[key] = new
        return self.casts[key]

    def node(self, index: int, node: Any) -> None:
        key = node.name or f"#{index}"
        schema = self._schema(node)
        floats = any(self.types.get(n) == FLOAT for n in [*node.input, *node.output])
        fp16 = schema is not None and floats and key not in self.kept and self._weights_fit(node)
        if key in self.kept and floats:
            self.kept_named.append(key)
        if node.op_type == "Cast" and fp16:
            to = next(a for a in node.attribute if a.name == "to")
            if to.i == FLOAT:
                to.i = FLOAT16
            self.now[node.output[0]] = to.i
            self.fp16_ops[node.op_type] += 1
            self.fp16_names.add(node.name)
            self.nodes.append(node)
            return
        for i, name in enumerate(node.input):
            if not name:
                continue
            orig = self.types.get(name, 0)
            convert = fp16 and orig == FLOAT and _fp16_allowed(schema, _formal(schema.inputs, i))
            want = FLOAT16 if convert else orig
            have = self.now.get(name, orig)
            if have != want and want in (FLOAT, FLOAT16):
                node.input[i] = self._cast(name, want)
        in_params = {p.type_str for p in schema.inputs} if schema is not None else set()
        for j, name in enumerate(node.output):
            orig = self.types.get(name, 0)
            param = _formal(schema.outputs, j) if schema is not None else None
            convert = (
                fp16
                and orig == FLOAT
                and param is not None
                and param.type_str in in_params
                and _fp16_allowed(schema, param)
            )
            self.now[name] = FLOAT16 if convert else orig
        (self.fp16_ops if fp16 else self.fp32_ops)[node.op_type] += floats
        if fp16 and node.name:
            self.fp16_names.add(node.name)
        self.nodes.append(node)

    def finish(self) -> None:
        g = self.graph
        for out in g.output:
            if self.now.get(out.name, FLOAT) == FLOAT16 and out.type.tensor_type.elem_type == FLOAT:
                inner = f"{out.name}__fp16"
                for n in self.nodes:
                    n.input[:] = [inner if x == out.name else x for x in n.input]
                    n.output[:] = [inner if x == out.name else x for x in n.output]
                self.nodes.append(
                    self.onnx.helper.make_node("Cast", [inner], [out.name], to=FLOAT, name=f"cast_{inner}")
                )
        del g.node[:]
        g.node.extend(self.nodes)
        used = {x for n in g.node for x in n.input}
        dead = [i for i in g.initializer if i.name not in used]
        for init in dead:
            g.initializer.remove(init)
        del g.value_info[:]


def _scale_axis(node: Any, arr: np.ndarray, ndim: int) -> np.ndarray:
    """A per-channel scale shaped to broadcast over its ``ndim``-dimensional weight."""
    if arr.ndim == 0 or ndim == 0:
        return arr
    axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
    shape = [1] * ndim
    shape[axis % ndim] = -1
    return arr.reshape(shape)


def raise_weight_scales(graph: Any) -> int:
    """Raise every weight scale below FP16's smallest normal to it (see the module's note);
    returns how many weights' scales were raised. Each weight keeps its dequantized value to
    within half the raised scale: an int8 weight dequantized directly is requantized to the new
    scale; a float weight quantized in the graph (weight -> QuantizeLinear -> DequantizeLinear)
    is first clipped to what its old scale could represent, so that the clipping it had stays."""
    from onnx import numpy_helper

    inits = {i.name: i for i in graph.initializer}
    users: collections.Counter[str] = collections.Counter(x for n in graph.node for x in n.input)
    raised = 0
    for node in graph.node:
        if node.op_type not in ("QuantizeLinear", "DequantizeLinear") or len(node.input) < 2:
            continue
        weight, scale = inits.get(node.input[0]), inits.get(node.input[1])
        if weight is None or scale is None or scale.data_type != FLOAT:
            continue
        old = numpy_helper.to_array(scale)
        if not (old < FP16_MIN_NORMAL).any():
            continue
        new = np.maximum(old, np.float32(FP16_MIN_NORMAL)).astype(np.float32)
        values = numpy_helper.to_array(weight)
        zero = inits.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        if zero is not None and numpy_helper.to_array(zero).any():
            continue  # an asymmetric weight (TensorRT refuses those anyway) is left alone
        if node.op_type == "QuantizeLinear" and weight.data_type == FLOAT:
            info = np.iinfo(numpy_helper.to_array(zero).dtype if zero is not None else np.uint8)
            step = _scale_axis(node, old, values.ndim)
            clipped = np.clip(values, info.min * step, info.max * step).astype(values.dtype)
            if not np.array_equal(clipped, values):
                _replace(graph, inits, node, 0, clipped, users)
        elif node.op_type == "DequantizeLinear" and values.dtype.kind in "iu":
            ratio = _scale_axis(node, old.astype(np.float64) / new, values.ndim)
            info = np.iinfo(values.dtype)
            requantized = np.clip(np.rint(values.astype(np.float64) * ratio), info.min, info.max)
            _replace(graph, inits, node, 0, requantized.astype(values.dtype), users)
        else:
            continue
        # The pair (Q and its DQ) reads one scale: shared only by them, it is raised in place.
        _replace(graph, inits, node, 1, new, users, pair=_pair(graph, node))
        raised += 1
    return raised


def _pair(graph: Any, node: Any) -> list[Any]:
    """The QuantizeLinear and the DequantizeLinear(s) that read its output: one weight's chain."""
    if node.op_type != "QuantizeLinear":
        return [node]
    return [node, *(n for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] == node.output[0])]


def _replace(
    graph: Any,
    inits: dict[str, Any],
    node: Any,
    index: int,
    value: np.ndarray,
    users: collections.Counter[str],
    pair: Sequence[Any] = (),
) -> None:
    from onnx import numpy_helper

    nodes = list(pair) or [node]
    name = node.input[index]
    readers = sum(1 for n in nodes for x in n.input if x == name)
    if users[name] == readers:  # nobody else reads it: replace it in place
        inits[name].CopyFrom(numpy_helper.from_array(value, name))
        return
    new = f"{name}__fp16_normal_{node.name or id(node)}"
    graph.initializer.append(numpy_helper.from_array(value, new))
    inits[new] = graph.initializer[-1]
    for n in nodes:
        n.input[:] = [new if x == name else x for x in n.input]
    users[name] -= readers
    users[new] += readers


def to_mixed_fp16(
    src: Path, dst: Path, keep_fp32: Sequence[str] = (), float_nodes: Sequence[str] = ()
) -> dict[str, Any]:
    """Write ``src`` with its float parts in FP16 to ``dst``; return a summary for the manifest.
    ``float_nodes``: the nodes the mixed-precision search kept out of INT8; the summary says how
    many of them run FP16 here (the rest are ones kept FP32 by the rules above)."""
    import onnx
    from onnx import version_converter

    try:
        model = onnx.load(str(src))
        opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
        if opset < FP16_OPSET:
            model = version_converter.convert_version(model, FP16_OPSET)
        model = onnx.shape_inference.infer_shapes(model)
    except Exception as e:  # onnx raises a zoo of errors for models it cannot convert
        raise BuildError(
            f"{src.name}: cannot prepare the model for FP16 ({type(e).__name__}: {e}); "
            "set [models.NAME.tensorrt] float_parts = 'fp32' to build it as it is"
        ) from None
    raised = raise_weight_scales(model.graph)
    work = _Pass(model, keep_fp32)
    for i, node in enumerate(list(model.graph.node)):
        work.node(i, node)
    work.finish()
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as e:
        raise BuildError(
            f"{src.name}: the FP16 conversion made an invalid model ({e}); "
            "set [models.NAME.tensorrt] float_parts = 'fp32' to build it as it is"
        ) from None
    onnx.save(model, str(dst))
    return {
        "opset": max(opset, FP16_OPSET),
        "fp16_nodes": sum(work.fp16_ops.values()),
        "fp32_nodes": sum(work.fp32_ops.values()),
        "fp32_ops": dict(work.fp32_ops.most_common(LISTED)),
        "kept_fp32": work.kept_named[:LISTED],
        "casts": sum(1 for n in model.graph.node if n.name.startswith("cast_")),
        "raised_weight_scales": raised,
        **(
            {"float_nodes_fp16": f"{len(set(float_nodes) & work.fp16_names)} of {len(set(float_nodes))}"}
            if float_nodes
            else {}
        ),
    }
