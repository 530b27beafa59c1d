#!/usr/bin/env bash
# The benchmarks on a machine that cannot reach a package index (a lab host, a GPU box), with the
# same JSON/Markdown reports as scripts/bench.sh, so a change can be compared on both machines.
#
#   scripts/bench_offline.sh prepare [PYTHON_VERSION]   # here, online: wheels into .whl/, models into data/
#   scripts/bench_offline.sh SUBCOMMAND [args]          # there, offline: install .whl/ into a private
#                                                       # folder, then python3 -m bench SUBCOMMAND [args]
#
# Copy the checkout with .whl/ and data/ (both git-ignored) to the other machine. The wheels are
# for CPython PYTHON_VERSION (default 3.12) on x86-64 Linux; the host's own numpy and onnx are used
# where it has them. Example: scripts/bench_offline.sh overhead --out /tmp/overhead.json
set -euo pipefail
cd "$(dirname "$0")/.."

# edged's runtime dependencies that an ML image usually lacks, at the versions this checkout runs;
# then what `grpc` needs: the gRPC service's grpcio and protobuf, and tritonclient.grpc (the
# client lanes and the floor's generated service) with what it imports.
PACKAGES=(uvicorn uvloop httptools orjson msgspec paho-mqtt onnxruntime
  grpcio protobuf tritonclient python-rapidjson ml-dtypes packaging urllib3)

if [ "${1:-}" = prepare ]; then
  pyver=${2:-3.12}
  [ -x .venv/bin/python ] || { echo "no .venv here: run scripts/demo.sh or scripts/test.sh first" >&2; exit 2; }
  pins=()
  for p in "${PACKAGES[@]}"; do
    pins+=("$p==$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$p'))")")
  done
  mkdir -p .whl
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl "${pins[@]}"
  # The hand-written FastAPI peer of `peers`, with what it needs (PyTriton needs its own venv and
  # Triton's server binary: it is left out there, and `peers` says so).
  python3 -m pip download -q --only-binary=:all: --python-version "$pyver" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl fastapi
  .venv/bin/python -c "from pathlib import Path; from bench.models import demo_onnx; demo_onnx(Path('data'))"  # not the 98 MB language model
  echo "ready: copy this checkout with .whl/ and data/, then run scripts/bench_offline.sh SUBCOMMAND there"
  exit 0
fi

site=${EDGED_BENCH_SITE:-/tmp/edged-bench-site}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec python3 -m bench "$@"
