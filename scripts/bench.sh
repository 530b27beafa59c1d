#!/usr/bin/env bash
# Every benchmark, from one command: sets up what the chosen one needs, then runs
# `python -m bench SUBCOMMAND [args]` (bench/__main__.py lists them).
#
#   scripts/bench.sh core [--quick]              # tiny over the socket, a frame via shm, cold start
#   scripts/bench.sh peers [--quick] [--publish docs/img]   # edged vs FastAPI vs PyTriton vs in-process
#   scripts/bench.sh first-request [--starts 7] [--stages] [--variants default,spinning]
#                                                # first request after READY=1 / after the same idle gap
#   scripts/bench.sh mqtt | int8 | auto | fuzz | soak | llm | overhead | batching | grpc
#
# Output goes under bench-results/. PyTriton (peers only) pins numpy<2, which the project's venv
# cannot take (it has numpy 2), so its server runs from its own venv, bench/.venv, built on the same
# base interpreter (Triton's Python backend stub links that interpreter's libpython) with the same
# onnxruntime as the project.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
.venv/bin/python -c 'import edged' 2>/dev/null || .venv/bin/python -m pip install -q -c scripts/constraints.txt -e '.[test]'
# The client side of the peers, and the plots. Not the `bench` extra: it names nvidia-pytriton.
.venv/bin/python -c 'import fastapi, matplotlib, tritonclient.http, tritonclient.utils.shared_memory' 2>/dev/null \
  || .venv/bin/python -m pip install -q fastapi matplotlib 'tritonclient[http]'
# grpc: Triton's gRPC client and the bare grpcio server of the floor.
if [ "${1:-}" = grpc ]; then
  .venv/bin/python -c 'import grpc, tritonclient.grpc' 2>/dev/null || .venv/bin/python -m pip install -q 'tritonclient[grpc]'
fi

if [ "${1:-}" = peers ]; then
  ORT_VERSION=$(.venv/bin/python -c 'import onnxruntime; print(onnxruntime.__version__)')
  if ! bench/.venv/bin/python -c 'import pytriton, onnxruntime as o, sys; sys.exit(o.__version__ != sys.argv[1])' \
      "$ORT_VERSION" 2>/dev/null; then
    BASE_PYTHON=$(.venv/bin/python -c 'import sys; print("%s/bin/python%d.%d" % (sys.base_prefix, *sys.version_info[:2]))')
    "$BASE_PYTHON" -m venv bench/.venv
    bench/.venv/bin/python -m pip install -q --upgrade pip
    bench/.venv/bin/python -m pip install -q nvidia-pytriton "onnxruntime==$ORT_VERSION"
  fi
fi

exec .venv/bin/python -m bench "$@"
