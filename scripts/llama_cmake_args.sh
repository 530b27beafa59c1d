#!/usr/bin/env bash
# The CMake options llama.cpp is built with (llama-cpp-python through CMAKE_ARGS, and the
# benchmark's llama-server), printed on one line. scripts/test.sh, scripts/demo.sh and
# bench/llama_server.py all read them here, so that edged and its peer run the same kernels.
#
# On x86-64 the build targets AVX2 instead of -march=native: llama.cpp's AMX kernels, which
# -march=native compiles in on a CPU with AMX, crashed every decode on a Sapphire Rapids VM
# (SIGSEGV on ldtilecfg in ggml_backend_amx_mul_mat, llama-cpp-python 0.3.36), and CI machines
# differ in their CPUs. Elsewhere (a Jetson's ARM cores) the native build stays.
set -euo pipefail
args=(-DLLAVA_BUILD=OFF)
if [ "$(uname -m)" = x86_64 ]; then
  args+=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
fi
echo "${args[*]}"
