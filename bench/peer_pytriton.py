"""PyTriton serving the benchmark's ONNX models through ONNX Runtime sessions in its callables.

Runs under bench/.venv (nvidia-pytriton pins numpy<2, the project's venv has numpy 2). Each model
is bound with PyTriton's defaults for a model with a dynamic batch dimension: batching on, the
dynamic batcher with no queue delay (it batches whatever is already queued), so concurrency
gets Triton's own batching. Sessions are created before Triton starts, as PyTriton's examples do.

    bench/.venv/bin/python -m bench.peer_pytriton SPECS_JSON HTTP_PORT GRPC_PORT
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig, TritonSecurityConfig

from bench.models import ModelSpec, read_specs, session

MAX_BATCH = {"tiny": 16}  # frames: up to 4 per batch


def make_infer(spec: ModelSpec, sess: Any) -> Callable[..., dict[str, np.ndarray]]:
    names = list(spec.outputs)

    def infer(**inputs: np.ndarray) -> dict[str, np.ndarray]:
        return dict(zip(names, sess.run(names, inputs)))

    batched: Callable[..., dict[str, np.ndarray]] = batch(infer)  # PyTriton joins a dynamic batch
    return batched


def out_shape(sess: Any, name: str) -> tuple[int, ...]:
    for o in sess.get_outputs():
        if o.name == name:
            return tuple(d if isinstance(d, int) else -1 for d in o.shape[1:])
    raise KeyError(name)


def main() -> None:
    specs = read_specs(Path(sys.argv[1]))
    cfg = TritonConfig(
        http_address="127.0.0.1",
        http_port=int(sys.argv[2]),
        grpc_address="127.0.0.1",
        grpc_port=int(sys.argv[3]),
        allow_metrics=False,
        log_verbose=0,
    )
    # PyTriton guards the shared memory API with a token; the benchmark's client sends this one.
    security = TritonSecurityConfig(access_token=os.environ["BENCH_TRITON_TOKEN"])
    with Triton(config=cfg, security_config=security) as triton:
        for spec in specs.values():
            sess = session(spec)
            triton.bind(
                model_name=spec.name,
                infer_func=make_infer(spec, sess),
                inputs=[Tensor(name=spec.input, dtype=np.float32, shape=spec.shape[1:])],
                outputs=[Tensor(name=o, dtype=np.float32, shape=out_shape(sess, o)) for o in spec.outputs],
                config=ModelConfig(
                    batching=True,
                    max_batch_size=MAX_BATCH.get(spec.name, 4),
                    batcher=DynamicBatcher(max_queue_delay_microseconds=0),
                ),
                strict=False,
            )
        triton.serve()


if __name__ == "__main__":
    main()
