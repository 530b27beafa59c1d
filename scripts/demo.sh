#!/usr/bin/env bash
# Install edged in .venv, fetch the demo models into data/, and serve them on data/run/edged.sock.
#   scripts/demo.sh
# The demo is CPU-only (ONNX Runtime, llama.cpp) and needs no broker. On the first run the vision
# models serve within a minute while llama-cpp-python builds from source in the background
# (minutes; its log is data/llama-cpp-python.log); the language model joins the running daemon
# once it is installed. On a Jetson, for the GPU: CMAKE_ARGS="-DGGML_CUDA=on" scripts/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# Without the llm extra: every other dependency is a binary wheel, so this takes seconds where
# llama-cpp-python's build takes minutes.
.venv/bin/python -m pip install -q -c scripts/constraints.txt -e .
.venv/bin/python -m edged.tools.demo data
if ! .venv/bin/python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llama_cpp") is None)'; then
  log=data/llama-cpp-python.log
  mapfile -t llm < <(.venv/bin/python -m edged.tools.demo --requirements llm)
  (
    # The build goes on when the demo stops (Ctrl-C, a closed terminal): the next run serves the
    # language model at once instead of building it again.
    trap '' HUP INT
    # A build from an earlier run still going installs it; the daemon picks it up all the same.
    flock -n 9 || exit 0
    echo "demo: building ${llm[*]} in the background (log: $log); smollm2 joins once it is installed" >&2
    # llama_install.sh builds llama-cpp-python with the project's options (and no stale wheel of
    # pip's cache); the extra's other requirements, if any, follow with the pin satisfied.
    if { bash scripts/llama_install.sh .venv/bin/python \
      && .venv/bin/python -m pip install -c scripts/constraints.txt "${llm[@]}"; } >"$log" 2>&1; then
      echo "demo: ${llm[*]} is installed; smollm2 joins the running daemon in a few seconds" >&2
    else
      echo "demo: ${llm[*]} did not install (see $log); the vision models keep serving" >&2
    fi
  ) 9>data/.llama-cpp-python.lock &
fi
echo "serving the demo on $(pwd)/data/run/edged.sock (Ctrl-C stops it)" >&2
exec .venv/bin/edged serve --config configs/demo.toml
