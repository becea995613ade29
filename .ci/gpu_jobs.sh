#!/usr/bin/env bash
# Several jobs in one call on the GPU machine (device tool, carry=[".carry"]), each given what is left of a time
# budget, so that the call ends inside the device's limit with every log it made:
#   LIMIT=570 bash .ci/gpu_jobs.sh "tests:test_fusion.py test_dynamic.py" "gtest:" \
#     'sh:timeout $budget python3 bench/dynamic.py --device cuda --only llama --out $L/llama.json'
# Jobs run in order; a job starts only with 20 s or more left, and gets the rest less 15 s:
#   tests:FILES   pytest over test/python/FILES (pytest-xdist on 12 workers where installed)
#   gtest:        the C++ tests, with the deployment packages they load exported on this GPU
#   sh:COMMAND    any command (bash), with $budget (its seconds) and $L (the log folder) set
# LIMIT: the budget in seconds, counted from the script's start (default 570). Logs go to $OUT/logs and are tarred
# into $OUT/logs.tgz at the end (the device tool brings back at most 8 files). Set-up: .ci/gpu_setup.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s) LIMIT=${LIMIT:-570}
source .ci/gpu_setup.sh
L=$OUT/logs
mkdir -p "$L"
trap 'tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"' EXIT
xdist=()
python3 -c "import xdist" 2>/dev/null && xdist=(-n 12)
n=0
for job in "$@"; do
  n=$((n + 1))
  kind=${job%%:*} arg=${job#*:}
  budget=$(( LIMIT - ($(date +%s) - T0) - 15 ))
  if [ "$budget" -lt 5 ]; then echo "== skipped $job: $(( budget + 15 )) s left"; continue; fi
  echo "== [$n] $job (${budget} s left, at $(( $(date +%s) - T0 )) s)"
  case $kind in
    tests)
      # shellcheck disable=SC2086  # FILES are words
      (cd test/python && timeout "$budget" python3 -m pytest -q -rfs -p no:cacheprovider "${xdist[@]}" $arg) > "$L/tests_$n.log" 2>&1
      echo "exit $?"; tail -15 "$L/tests_$n.log" ;;
    gtest)
      export EMBER_PACKAGE_TEST_DIR=/tmp/ember_packages
      python3 test/python/write_test_packages.py "$EMBER_PACKAGE_TEST_DIR" --device cuda > "$L/packages.log" 2>&1 || tail -5 "$L/packages.log"
      timeout "$budget" ./build/py/test/cpp/ember_tests --gtest_brief=1 > "$L/gtest_$n.log" 2>&1
      echo "exit $?"; tail -5 "$L/gtest_$n.log" ;;
    sh)
      (export budget L; bash -c "$arg") > "$L/sh_$n.log" 2>&1
      echo "exit $?"; tail -40 "$L/sh_$n.log" ;;
    *)
      echo "unknown job kind '$kind' (tests:, gtest:, sh:)" ;;
  esac
done
echo "== done at $(( $(date +%s) - T0 )) s"
