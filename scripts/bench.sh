#!/usr/bin/env bash
# Issue 7's benchmark: edged against PyTriton, a hand-written FastAPI server and in-process ONNX
# Runtime (the floor), on the same models, in one run. Sets up what it needs, then runs bench/run.py.
#
#   scripts/bench.sh --quick                    # a few minutes
#   scripts/bench.sh                            # the full run (about 10 minutes)
#   scripts/bench.sh --publish docs/img         # also copy the PNGs for docs/performance.md
#
# Output: bench-results/bench.json, bench-results/bench.md and bench-results/*.png.
# PyTriton pins numpy<2, which the project's venv cannot take (it has numpy 2), so PyTriton's
# server runs from its own venv, bench/.venv, built on the same base interpreter (Triton's Python
# backend stub links that interpreter's libpython) with the same onnxruntime as the project.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
.venv/bin/python -c 'import edged' 2>/dev/null || .venv/bin/python -m pip install -q -e .
# The client side of the peers, and the plots. Not the `bench` extra: it names nvidia-pytriton.
.venv/bin/python -c 'import fastapi, matplotlib, tritonclient.http, tritonclient.utils.shared_memory' 2>/dev/null \
  || .venv/bin/python -m pip install -q fastapi matplotlib 'tritonclient[http]'

ORT_VERSION=$(.venv/bin/python -c 'import onnxruntime; print(onnxruntime.__version__)')
if ! bench/.venv/bin/python -c 'import pytriton, onnxruntime as o, sys; sys.exit(o.__version__ != sys.argv[1])' \
    "$ORT_VERSION" 2>/dev/null; then
  BASE_PYTHON=$(.venv/bin/python -c 'import sys; print("%s/bin/python%d.%d" % (sys.base_prefix, *sys.version_info[:2]))')
  "$BASE_PYTHON" -m venv bench/.venv
  bench/.venv/bin/python -m pip install -q --upgrade pip
  bench/.venv/bin/python -m pip install -q nvidia-pytriton "onnxruntime==$ORT_VERSION"
fi

exec .venv/bin/python -m bench.run "$@"
