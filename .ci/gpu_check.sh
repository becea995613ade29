#!/usr/bin/env bash
# One call on the GPU machine (device tool, carry=[".carry"]): build, C++ tests, pytest, benchmarks; logs under $OUT.
#   bash .ci/gpu_check.sh [pytest args; default: every test]
# What travels in .carry/ and how ember is installed there: .ci/gpu_setup.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
source .ci/gpu_setup.sh
xdist=()
python3 -c "import xdist" 2>/dev/null && xdist=(-n 12)
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
