"""One entry point for every benchmark: ``python -m bench SUBCOMMAND [args]`` (``scripts/bench.sh``
sets up what they need first). Each subcommand is a module of this package with a
``main(argv) -> int | None``; ``python -m bench SUBCOMMAND --help`` shows its options.

Every benchmark interleaves what it compares in one run (the machines are shared and noisy),
prints ratios and writes its results under bench-results/.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, what it measures); modules are imported only when chosen.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "core": ("bench.core", "tiny model over the socket, a frame via shm, first request, restart to ready"),
    "peers": ("bench.peers", "edged against PyTriton, FastAPI and in-process ONNX Runtime (JSON, Markdown, PNG)"),
    "mqtt": ("bench.mqtt", "MQTT round trips against a plain paho echo through the same broker"),
    "int8": ("bench.int8", "INT8 (mixed) against FP32 on real models: task metric, latency, search"),
    "auto": ("bench.auto", 'precision = "auto" against an explicit int8 build of the demo detector: time, choice'),
    "fuzz": ("bench.fuzz", "mutated requests and hostile peers against a live daemon: crashes, stalls, 5xx, RSS"),
    "soak": ("bench.soak", "mixed socket, shm and MQTT clients with a reload and a broker restart"),
    "llm": ("bench.llm", "language model: TTFT, tokens/s, restarts against llama-server and llama_cpp.server"),
    "first-request": (
        "bench.first_request",
        "first request after READY=1 against one after the same idle gap, per stage",
    ),
    "batching": ("bench.batching", "dynamic batching against none: c=1 p50 and throughput, side by side"),
    "fleet": ("bench.fleet", "a fleet on two bridged brokers: publish to all serving, heartbeat bytes, 200 simulated"),
    "bundle": ("bench.bundle", "checking a signed model bundle against hashing its bytes once"),
    "grpc": ("bench.grpc", "edged's gRPC against a bare grpcio server and edged's HTTP: tiny p50/p99, a frame via shm"),
    "overhead": (
        "bench.overhead",
        "where a request's time goes outside the model: edged against its twin, FastAPI and the limits",
    ),
}


def usage() -> str:
    lines = ["usage: python -m bench SUBCOMMAND [args]   (or scripts/bench.sh SUBCOMMAND [args])", ""]
    lines += [f"  {name:<14} {what}" for name, (_, what) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        print(usage(), file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
    result = module.main(argv[1:])
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
