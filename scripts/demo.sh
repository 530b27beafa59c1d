#!/usr/bin/env bash
# Install edged in .venv, fetch the demo models into data/, and serve them on data/run/edged.sock.
#   scripts/demo.sh
# The demo is CPU-only (ONNX Runtime, llama.cpp) and needs no broker.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# llama-cpp-python builds from source the first time (minutes); on a Jetson, for the GPU:
#   CMAKE_ARGS="-DGGML_CUDA=on" scripts/demo.sh
CMAKE_ARGS="${CMAKE_ARGS:--DLLAVA_BUILD=OFF}" .venv/bin/python -m pip install -q -c scripts/constraints.txt -e '.[llm]'
.venv/bin/python -m edged.tools.demo data
echo "serving the demo on $(pwd)/data/run/edged.sock (Ctrl-C stops it)" >&2
exec .venv/bin/edged serve --config configs/demo.toml
