#!/usr/bin/env bash
# The long GPU checks, one call on the GPU machine each (device tool, carry=[".carry"]; logs under $OUT):
#   bash .ci/gpu_soak.sh fuzz MODE N SEED  N fuzzed programs (graph_fuzz.py) in MODE (default or reduce-overhead),
#                                        stopping after FUZZ_SECONDS (default 420) so that one call fits 10 minutes
#   bash .ci/gpu_soak.sh memcheck         compute-sanitizer memcheck over the CUDA-graph and training tests
#   bash .ci/gpu_soak.sh train STEPS      BertModel(BertConfig()) trained STEPS steps in reduce-overhead (bench/train_soak.py)
#   bash .ci/gpu_soak.sh zoo              every bench/zoo.py model trained 20 steps in reduce-overhead
# How ember is installed there: .ci/gpu_setup.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
source .ci/gpu_setup.sh
workers=$(( $(nproc) - 2 ))
case "${1:-}" in
  fuzz)
    mode=${2:-default}
    mkdir -p "$OUT/fuzz-$mode"
    python3 test/fuzz/graph_fuzz.py --count "${3:-1000}" --seed "${4:-0}" --device cuda --mode "$mode" \
      --workers "$workers" --progress 1000 --time-budget "${FUZZ_SECONDS:-420}" --shrink-budget 60 \
      --out "$OUT/fuzz-$mode" > "$OUT/fuzz-$mode/log.txt" 2>&1
    echo "fuzz $mode exit $?"; tail -1 "$OUT/fuzz-$mode/log.txt"
    ;;
  memcheck)
    (cd test/python && compute-sanitizer --tool memcheck --target-processes all --print-limit 20 \
      python3 -m pytest -q -p no:cacheprovider test_cudagraphs.py test_reduce_overhead_training.py) > "$OUT/memcheck.log" 2>&1
    echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -5
    ;;
  train)
    python3 bench/train_soak.py --steps "${2:-200}" --mode reduce-overhead 2>&1 | tee "$OUT/train.log" | tail -4
    ;;
  zoo)
    python3 bench/zoo.py --device cuda --train --mode reduce-overhead --steps 20 --out "$OUT/zoo_ro_train.json" \
      > "$OUT/zoo.log" 2>&1
    echo "zoo exit $?"; tail -30 "$OUT/zoo.log"
    ;;
  *)
    sed -n 2,6p "$0"; exit 2
    ;;
esac
