#!/usr/bin/env bash
# Installs what ember needs and builds it (with its C++ tests) into the current Python.
# Idempotent: what is already there is kept (on the GPU machine: its torch 2.11 and toolchain).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# A torch already installed is kept: ember builds against it. Otherwise the CPU build: PyTorch's CPU index first,
# given 5 s and no retries (it is often unreachable from build machines), then the configured index; torch==2.13.0,
# the version the tests run on, either way.
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "== installing torch (CPU build)"
  if ! "$PY" -m pip install -q --timeout 5 --retries 0 --index-url https://download.pytorch.org/whl/cpu torch==2.13.0; then
    echo "== PyTorch's CPU index not reachable; torch==2.13.0 from the configured index"
    "$PY" -m pip install -q torch==2.13.0
  fi
fi
missing=()
"$PY" -c "import scikit_build_core" 2>/dev/null || missing+=("scikit-build-core>=0.10")
"$PY" -c "import pytest" 2>/dev/null || missing+=("pytest")
command -v ninja >/dev/null || "$PY" -c "import ninja" 2>/dev/null || missing+=("ninja")
command -v cmake >/dev/null || missing+=("cmake>=3.25")
if [ ${#missing[@]} -gt 0 ]; then
  echo "== installing ${missing[*]}"
  "$PY" -m pip install -q "${missing[@]}"
fi

# GoogleTest comes from Debian (libgtest-dev); GTest_ROOT may point at an unpacked copy instead.
if [ ! -f /usr/include/gtest/gtest.h ] && [ -z "${GTest_ROOT:-}" ]; then
  echo "== installing libgtest-dev"
  if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq libgtest-dev >/dev/null
  else sudo apt-get update -qq && sudo apt-get install -y -qq libgtest-dev >/dev/null; fi
fi

# oneDNN (CPU matmul epilogues) from Debian's libdnnl-dev; dnnl_ROOT may point at an unpacked copy instead.
# ember builds without it (CPU matmuls then run through ATen), so a failed install is not fatal.
if [ ! -f /usr/include/oneapi/dnnl/dnnl.hpp ] && [ -z "${dnnl_ROOT:-}" ]; then
  echo "== installing libdnnl-dev"
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  { $sudo apt-get update -qq && $sudo apt-get install -y -qq libdnnl-dev >/dev/null; } || echo "libdnnl-dev not installed"
fi

echo "== building ember"
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
editable=()
[ "${EMBER_EDITABLE:-0}" = 1 ] && editable=(-e)
"$PY" -m pip install -q --no-build-isolation --no-deps \
  -Cbuild-dir=build/py -Ccmake.define.EMBER_BUILD_TESTS=ON "${editable[@]}" .
