"""Automatic mixed precision: when the all-INT8 model fails its gate, find a small set of nodes to
keep in float so that the rest can stay INT8 and pass.

1. Rank the weighted nodes (Conv, ConvTranspose, Gemm, MatMul) by sensitivity, measured on
   calibration samples in one pass: the Q/DQ model (run unoptimised, so every QuantizeLinear /
   DequantizeLinear pair does exactly what it says) and the FP32 model expose each node's input
   and output; a node's sensitivity is the relative error its output has against FP32 minus the
   error its input already had: what quantizing this node's input and weights adds.
2. Exclude the k most sensitive nodes, for k = 1, 2, 4, ... until a trial passes the gate, then
   bisect between the last failing and the first passing k. Each trial is a real model built and
   judged as the final one is (one trial model per step, at most ``max_trials`` including the
   all-INT8 one).

The nested exclusion sets make the search a search over one number, so it is bounded by
log2(nodes) + a few trials. The result records every trial's figures and the share of the
multiply-accumulates (MACs) left in INT8, which is what decides the speed.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

log = logging.getLogger(__name__)

WEIGHTED_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
Feed = dict[str, np.ndarray]
TrialFn = Callable[[list[str]], dict[str, Any]]  # excluded nodes -> the gate's dict


@dataclass(frozen=True)
class NodeInfo:
    name: str
    op_type: str
    sensitivity: float
    macs: int


@dataclass
class SearchResult:
    excluded: list[str]
    passed: bool
    trials: list[dict[str, Any]] = field(default_factory=list)
    int8_mac_fraction: float = 1.0
    int8_node_fraction: float = 1.0
    seconds: float = 0.0
    gate: dict[str, Any] | None = None  # the chosen trial's gate

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "excluded": self.excluded,
            "int8_mac_fraction": round(self.int8_mac_fraction, 4),
            "int8_node_fraction": round(self.int8_node_fraction, 4),
            "trials": self.trials,
            "seconds": round(self.seconds, 2),
        }


# --- ranking -------------------------------------------------------------------------------------


def weighted_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The nodes whose precision the search decides, in graph (topological) order."""
    inits = {i.name for i in model.graph.initializer}
    return [
        n
        for n in model.graph.node
        if n.op_type in WEIGHTED_OPS and n.name and len(n.input) > 1 and n.input[0] not in inits
    ]


def _with_outputs(model: onnx.ModelProto, names: Iterable[str]) -> bytes:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    for name in names:
        if name not in have:
            m.graph.output.append(helper.make_empty_tensor_value_info(name))
            have.add(name)
    return m.SerializeToString()


def _session(model_bytes: bytes, optimise: bool) -> Any:
    import onnxruntime as ort

    from edged.backends.onnxruntime import SESSION_CONFIG

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if not optimise:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    for k, v in SESSION_CONFIG.items():
        so.add_session_config_entry(k, v)
    return ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])


def _macs(node: onnx.NodeProto, weights: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> int:
    w = weights.get(node.input[1])
    if node.op_type == "Conv" and w is not None:
        return int(y.size * (w.size // max(1, w.shape[0])))
    if node.op_type == "ConvTranspose" and w is not None:
        return int(x.size * (w.size // max(1, w.shape[0])))
    return int(y.size * (x.shape[-1] if x.ndim else 1))  # Gemm, MatMul: K per output element


def rank(prepared: Path, qdq: Path, feeds: Sequence[Feed]) -> list[NodeInfo]:
    """Weighted nodes of ``prepared`` (the model the quantizer read), most sensitive first."""
    fp32 = onnx.load(str(prepared))
    quant = onnx.load(str(qdq))
    nodes = weighted_nodes(fp32)
    quantized = {n.name for n in quant.graph.node}
    nodes = [n for n in nodes if n.name in quantized]
    names = sorted({t for n in nodes for t in (n.input[0], n.output[0])})
    ref = _session(_with_outputs(fp32, names), optimise=True)
    cand = _session(_with_outputs(quant, names), optimise=False)
    diff = dict.fromkeys(names, 0.0)
    norm = dict.fromkeys(names, 0.0)
    shapes: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for feed in feeds:
        a = dict(zip(names, ref.run(names, feed)))
        b = dict(zip(names, cand.run(names, feed)))
        for t in names:
            d = a[t].astype(np.float64) - b[t]
            diff[t] += float((d * d).sum())
            norm[t] += float((a[t].astype(np.float64) ** 2).sum())
        if not shapes:
            shapes = {n.name: (a[n.input[0]], a[n.output[0]]) for n in nodes}
    weighted = {n.input[1] for n in nodes}
    weights = {i.name: numpy_helper.to_array(i) for i in fp32.graph.initializer if i.name in weighted}

    def err(t: str) -> float:
        return math.sqrt(diff[t] / norm[t]) if norm[t] > 0 else 0.0

    infos = [
        NodeInfo(n.name, n.op_type, err(n.output[0]) - err(n.input[0]), _macs(n, weights, *shapes[n.name]))
        for n in nodes
    ]
    return sorted(infos, key=lambda i: -i.sensitivity)


# --- the search ----------------------------------------------------------------------------------


def fractions(infos: Sequence[NodeInfo], excluded: Iterable[str]) -> tuple[float, float]:
    """(share of MACs in INT8, share of weighted nodes in INT8)."""
    out = set(excluded)
    total = sum(i.macs for i in infos)
    int8 = sum(i.macs for i in infos if i.name not in out)
    n = len(infos)
    return (int8 / total if total else 1.0), ((n - len(out & {i.name for i in infos})) / n if n else 1.0)


def search(infos: Sequence[NodeInfo], trial: TrialFn, max_trials: int, first: dict[str, Any]) -> SearchResult:
    """Exclude the k most sensitive nodes (``infos`` ranked), k found by doubling then bisection.
    ``first`` is the all-INT8 trial's gate (a failure), counted as trial 1 of ``max_trials``."""
    started = time.monotonic()
    order = [i.name for i in infos]
    trials: list[dict[str, Any]] = [_record(0, [], first, infos, 0.0)]
    gates: dict[int, dict[str, Any]] = {0: first}

    def run(k: int) -> bool:
        t0 = time.monotonic()
        gate = trial(order[:k])
        gates[k] = gate
        trials.append(_record(k, order[:k], gate, infos, time.monotonic() - t0))
        log.info("mixed precision trial %d: %d nodes in float: %s", len(trials), k, gate.get("reason", ""))
        return bool(gate.get("passed"))

    bad, good = 0, None
    limit = len(order) - 1 if len(order) > 1 else len(order)
    k = 1
    while good is None and len(trials) < max_trials and k <= limit:
        if run(k):
            good = k
        else:
            bad, k = k, min(k * 2, limit) if k < limit else limit + 1
    while good is not None and good - bad > 1 and len(trials) < max_trials:
        mid = (bad + good) // 2
        if run(mid):
            good = mid
        else:
            bad = mid
    excluded = order[:good] if good is not None else []
    mac, nodes = fractions(infos, excluded)
    return SearchResult(
        excluded=excluded,
        passed=good is not None,
        trials=trials,
        int8_mac_fraction=mac,
        int8_node_fraction=nodes,
        seconds=time.monotonic() - started,
        gate=gates.get(good) if good is not None else None,
    )


def _record(
    k: int, excluded: list[str], gate: dict[str, Any], infos: Sequence[NodeInfo], secs: float
) -> dict[str, Any]:
    mac, _ = fractions(infos, excluded)
    figures = {m: gate.get(m) for m in ("rel_l2", "cosine", "top1", "mask_iou", "det_f1") if gate.get(m) is not None}
    return {
        "float_nodes": k,
        "passed": bool(gate.get("passed")),
        "int8_mac_fraction": round(mac, 4),
        **figures,
        "seconds": round(secs, 2),
    }
