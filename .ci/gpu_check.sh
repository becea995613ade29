#!/usr/bin/env bash
# One call on the GPU machine (device tool): build, C++ tests, pytest, benchmarks; logs under $OUT.
# GoogleTest travels as Debian's .deb in .carry/ (the machine has no registries):
#   mkdir -p .carry && (cd .carry && apt-get download libgtest-dev)   # here, once
# then run with carry=[".carry"]:  bash .ci/gpu_check.sh [pytest args; default: every test]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ember_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .carry/libgtest-dev_*.deb >/dev/null 2>&1; then
  dpkg -x .carry/libgtest-dev_*.deb /tmp/gtest && export GTest_ROOT=/tmp/gtest/usr
fi
# oneDNN the same way (libdnnl2, libdnnl-dev and the OpenCL loader libdnnl.so.2 links against):
#   (cd .carry && apt-get download libdnnl2 libdnnl-dev ocl-icd-libopencl1)
# CMake finds it through dnnl_ROOT; the loader finds libdnnl.so.2 and libOpenCL.so.1 through LD_LIBRARY_PATH.
if ls .carry/libdnnl2_*.deb .carry/libdnnl-dev_*.deb >/dev/null 2>&1; then
  for deb in .carry/libdnnl2_*.deb .carry/libdnnl-dev_*.deb .carry/ocl-icd-libopencl1_*.deb; do
    [ -f "$deb" ] && dpkg -x "$deb" /tmp/dnnl
  done
  export dnnl_ROOT=/tmp/dnnl/usr
  export LD_LIBRARY_PATH=/tmp/dnnl/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
# pytest-xdist the same way, as wheels (the whole suite takes ~150 s with -n 12 there):
#   (cd .carry && mkdir -p wheels && pip download -d wheels --no-deps pytest-xdist execnet)
if ls .carry/wheels/*.whl >/dev/null 2>&1; then python3 -m pip install -q --no-index .carry/wheels/*.whl; fi
xdist=()
python3 -c "import xdist" 2>/dev/null && xdist=(-n 12)
{ nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"; } 2>&1 | tee "$OUT/device.txt"
# A build of an earlier call travels as .carry/ember-prebuilt.tgz (.ci/prebuilt.sh): installed in seconds where
# the C++ sources are unchanged. Each build leaves one in $OUT: copy it to .carry/ for the next call.
start=$(date +%s)
if bash .ci/prebuilt.sh unpack .carry/ember-prebuilt.tgz; then
  echo "build: prebuilt, $(( $(date +%s) - start )) s"
else
  bash .ci/install.sh > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - start )) s"
  bash .ci/prebuilt.sh pack "$OUT/ember-prebuilt.tgz"
fi
# Deployment packages exported on this GPU, for the C++ test that loads them (test/cpp/package_test.cpp).
export EMBER_PACKAGE_TEST_DIR=/tmp/ember_packages
python3 test/python/write_test_packages.py "$EMBER_PACKAGE_TEST_DIR" --device cuda > "$OUT/packages.log" 2>&1 || tail -20 "$OUT/packages.log"
# The C++ tests run beside pytest (they use one or two cores of the machine's 16), which saves their ~135 s.
./build/py/test/cpp/ember_tests --gtest_brief=1 > "$OUT/gtest.log" 2>&1 &
gtests=$!
(cd test/python && python3 -m pytest -q -rfs -p no:cacheprovider "${xdist[@]}" "${@:-.}" 2>&1) | tee "$OUT/pytest.log" | tail -25
wait $gtests; echo "gtests exit $?"; tail -3 "$OUT/gtest.log"
for script in ${EMBER_GPU_BENCH:-}; do
  echo "== $script"
  timeout 300 python3 $script 2>&1 | tee -a "$OUT/bench.log" | tail -40
done
