#!/usr/bin/env bash
# Everything the tests need, from a fresh Debian/Ubuntu machine, then lint, types and the tests.
#   scripts/test.sh [pytest args...]
# CI runs exactly this (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
APT_PACKAGES=(mosquitto mosquitto-clients libsystemd-dev pkg-config gcc systemd openssl)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# The `llm` extra's llama-cpp-python has no wheel for every platform: pip builds it from source
# once (minutes; the multimodal library is not built, edged serves text), then reuses it: an
# installed version that satisfies the pin is not rebuilt, and pip's wheel cache serves a fresh venv.
CMAKE_ARGS="${CMAKE_ARGS:--DLLAVA_BUILD=OFF}" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
  .venv/bin/python -m pip install -q -c scripts/constraints.txt -e '.[test]'
# The TensorRT type stubs name `tensorrt` as a dependency, which only NVIDIA's index serves:
# install the stubs alone so mypy can check the TensorRT backend against the real API.
.venv/bin/python -m pip install -q --no-deps tensorrt-stubs

.venv/bin/ruff check edged tests scripts bench
.venv/bin/ruff format --check edged tests scripts bench
.venv/bin/mypy
exec .venv/bin/python -m pytest -ra "$@"
