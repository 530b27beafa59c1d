#!/usr/bin/env bash
# Install llama-cpp-python into a venv, built with the options of scripts/llama_cmake_args.sh.
#   scripts/llama_install.sh VENV_PYTHON
#   scripts/llama_install.sh --key VENV_PYTHON   (prints the build's key and installs nothing)
# pip's wheel cache keys a source build by the sdist alone, not by CMAKE_ARGS: a wheel built once
# with other options (-march=native, whose AMX kernels crash every decode on a Sapphire Rapids
# VM) is installed again by every later `pip install`, whatever CMAKE_ARGS says. So the build is
# done here with pip's cache off, kept in a folder of its own named by a digest of the version, the
# options and the platform, and installed from there; the venv records the digest it holds, so a
# second run installs nothing and a change of options rebuilds once.
set -euo pipefail
cd "$(dirname "$0")/.."
print_key=0
if [ "${1:-}" = --key ]; then
  print_key=1
  shift
fi
py=${1:?usage: scripts/llama_install.sh [--key] VENV_PYTHON}

version=$(sed -n 's/^llama-cpp-python==\([^ ;]*\).*/\1/p' scripts/constraints.txt)
[ -n "$version" ] || { echo "llama_install: no llama-cpp-python pin in scripts/constraints.txt" >&2; exit 1; }
cmake_args="${CMAKE_ARGS:-$(bash scripts/llama_cmake_args.sh)}"
tag=$("$py" -c 'import sys, sysconfig; print(sys.implementation.cache_tag, sysconfig.get_platform())')
key=$(printf '%s\n' "$version" "$cmake_args" "$tag" | sha256sum | cut -c1-16)
if [ "$print_key" = 1 ]; then
  echo "$key"
  exit 0
fi

venv=$("$py" -c 'import sys; print(sys.prefix)')
stamp="$venv/.llama-cpp-python-build"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ] \
  && "$py" -c 'import importlib.metadata as m, sys; sys.exit(m.version("llama-cpp-python") != sys.argv[1])' "$version" 2>/dev/null; then
  exit 0
fi

wheels="${EDGED_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/edged/llama-wheels}/$key"
if ! ls "$wheels"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  echo "llama_install: building llama-cpp-python $version ($cmake_args) into $wheels (minutes)" >&2
  mkdir -p "${wheels%/*}"
  tmp=$(mktemp -d "${wheels%/*}/.build.XXXXXX")
  CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
    "$py" -m pip wheel -q --no-cache-dir --no-deps --no-binary llama-cpp-python \
    -w "$tmp" "llama-cpp-python==$version"
  # A build cut short leaves no folder under the key: the next run builds again.
  rm -rf "$wheels"
  mv "$tmp" "$wheels"
fi
"$py" -m pip install -q --force-reinstall --no-deps "$wheels"/llama_cpp_python-*.whl
# Its own dependencies (numpy, jinja2, diskcache, typing-extensions), from the pins.
"$py" -m pip install -q -c scripts/constraints.txt "llama-cpp-python==$version"
echo "$key" >"$stamp"
