#!/usr/bin/env bash
# Everything the tests need, from a fresh Debian/Ubuntu machine, then lint, types and the tests.
#   scripts/test.sh [pytest args...]
# CI runs exactly this (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
# prometheus: its promtool checks the /metrics output (tests/*/test_metrics.py).
# g++: llama-cpp-python builds llama.cpp (C and C++) from source.
APT_PACKAGES=(mosquitto mosquitto-clients libsystemd-dev pkg-config gcc g++ systemd openssl prometheus)

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
# The `llm` extra's llama-cpp-python has no wheel for every platform: it is built from source once
# (minutes; the options are scripts/llama_cmake_args.sh's) and kept under a key of its version and
# options, which pip's own wheel cache does not honour (scripts/llama_install.sh says why). The
# install of the package below then finds the pin satisfied and builds nothing.
bash scripts/llama_install.sh .venv/bin/python
.venv/bin/python -m pip install -q -c scripts/constraints.txt -e '.[test]'
# The TensorRT type stubs name `tensorrt` as a dependency, which only NVIDIA's index serves:
# install the stubs alone so mypy can check the TensorRT backend against the real API.
.venv/bin/python -m pip install -q --no-deps tensorrt-stubs

# The commit-message rule of CONTRIBUTING.md, on every commit since the rule began.
if git rev-parse --git-dir >/dev/null 2>&1; then
  .venv/bin/python scripts/check_commits.py
fi
.venv/bin/ruff check edged tests scripts bench
.venv/bin/ruff format --check edged tests scripts bench
.venv/bin/mypy
.venv/bin/lint-imports --no-cache

# JetPack 6 runs Python 3.10: when this machine has one, the unit tests run under it too, in
# .venv310 (a pyenv shim that cannot run 3.10 does not count; PYTHON310=none turns this off).
find_python310() {
  local cand
  for cand in "${PYTHON310:-}" python3.10 /usr/bin/python3.10 "$(pyenv root 2>/dev/null)"/versions/3.10*/bin/python3.10; do
    if [ -n "$cand" ] && "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 10)' >/dev/null 2>&1; then
      echo "$cand"
      return 0
    fi
  done
  return 1
}
status310=0
if [ "${PYTHON310:-}" != none ] && py310=$(find_python310); then
  [ -x .venv310/bin/python ] || "$py310" -m venv .venv310
  .venv310/bin/python -m pip install -q --upgrade pip
  # Unit tests only, which need no language-model engine: no second build of llama.cpp.
  .venv310/bin/python -m pip install -q -c scripts/constraints.txt -e '.[test-core]'
  .venv310/bin/python -m pip install -q --no-deps tensorrt-stubs
  echo "unit tests under $(.venv310/bin/python --version)"
  # A failure here fails the run, after the main suite has run too.
  .venv310/bin/python -m pytest -q -ra -p no:cacheprovider tests/unit || status310=$?
else
  echo "no Python 3.10 here: the unit tests run under $(.venv/bin/python --version) only"
fi

.venv/bin/python -m pytest -ra "$@"
exit "$status310"
