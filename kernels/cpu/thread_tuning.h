// max-autotune's thread tuning of fused CPU kernels (issue #61): at a call shape's first call, the kernel's run with
// at most 1, 2, 4, ... threads taking part is timed on the call's own buffers and the fastest cap kept for that
// kernel and shape. The model is the CUDA launch tuning (kernels/cuda/launch_tuning.h).
//  1. Only under Tuning::exhaustive (mode="max-autotune", options={"autotune": True}); the default mode's kernels
//     carry no tuner and run as they always did: every loop with ATen's threads and its default grain.
//  2. A cap of T threads is a larger grain: with ATen's OpenMP backend a loop over n items of grain g takes
//     min(threads, ceil(n / g)) of them, so grain max(g, ceil(n / T)) takes at most T (interpreter.cpp: ThreadCap);
//     column groups, which split their work by the thread count, split it for T. The candidates: the default (no
//     cap) first, then 1, 2, 4, ... below the most threads the default's loops could take; a shape whose loops
//     take one thread (a small one) has nothing to choose and is not timed.
//  3. Timing: a steady clock, the median of 5 or more runs (enough to fill about 2 ms, at most 25) after a
//     warm-up run; a candidate whose warm-up takes over 4 times the best so far (and 50 us) is not repeated.
//     Every run writes the outputs the call allocated, and the call's own run, with the winner, comes last.
//  4. The winner: the fastest, where at least kMinGain faster than the default (else the default: the choice
//     does not flip on noise). The wall time is charged to the graph's TuningBudget; once spent, shapes met later
//     run with the default and the one being timed keeps its best so far.
//  5. Per call: find() compares the call's shape (numel, rows, cols, the kernel's path, ATen's thread count) with
//     those chosen for, without a lock or an allocation. Up to kMaxShapes shapes per kernel are chosen for (a
//     symbolic graph meets several sizes); later shapes run with the default. Choosing takes a mutex.
//  6. Each timed choice goes to <cache dir>/cpu (choice_record.h), keyed by the host, the kernel (`identity`: its
//     instruction set and program) and the shape; a later process reads it instead of timing, and uses it only
//     where the cap is one this call could time (below ATen's thread count).
// Built once, not per instruction set as interpreter.cpp is: nothing here is inline, so that no copy built for
// AVX-512 can be the one an AVX2 host links to.
#pragma once

#include "ember/runtime.h"

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace ember::cpu {

// A call's shape, as the tuner tells calls apart.
struct ThreadShape {
  int64_t numel = 0, rows = 0, cols = 0;
  int64_t path = 0;     // which of the kernel's loops runs the call
  int64_t threads = 1;  // at::get_num_threads() at the call
};

// One candidate's time: `cap` threads at most (0: the default), `ms` the median (a single run where `runs` is 1).
struct ThreadTiming {
  int64_t cap = 0;
  double ms = 0;
  int runs = 0;
};

class ThreadTuner {
 public:
  static constexpr size_t kMaxShapes = 8;
  static constexpr double kMinGain = 0.03;
  static constexpr int64_t kUnchosen = -1;

  // `identity` names the kernel in disk records (choice_record.h): its instruction set and program text; empty:
  // none are read or written.
  ThreadTuner(Tuning tuning, std::string identity);

  // The cap chosen for `shape` (0: the default), or kUnchosen.
  int64_t find(const ThreadShape& shape) const;
  // No more shapes are chosen for: calls of new shapes run with the default.
  bool full() const;

  // Chooses the cap of `shape` (`what` names it in lines()): the default where the budget is spent, else by
  // timing `run(cap)`, which runs the call with at most `cap` threads (0: the default) and returns the most
  // threads its loops could take. kUnchosen where the table is full.
  int64_t choose(const ThreadShape& shape, const std::string& what, const std::function<int64_t(int64_t)>& run);

  // ember.explain's lines, one per shape chosen for: "1048576 elements on 2 threads: at most 1 thread
  // (max-autotune); timed: default 2 threads 44.0 us, at most 1 thread 41.2 us".
  std::vector<std::string> lines() const;

  // The rule of point 4: the cap of the fastest timing, where at least kMinGain faster than the default's
  // (timings[0]); 0 (the default) otherwise.
  static int64_t winner(const std::vector<ThreadTiming>& timings);

 private:
  struct Report {
    std::string what, how;  // how: "max-autotune", "default: budget spent", ...
    int64_t cap = 0, threads = 1;  // the winner; ATen's threads at the call
    int64_t most = 0;              // the most threads the default's loops could take (0: not run)
    std::vector<ThreadTiming> timings;
  };
  int64_t keep(const ThreadShape& shape, int64_t cap, Report report);
  std::string record_key(const ThreadShape& shape) const;

  const Tuning tuning_;
  const std::string identity_;
  std::array<ThreadShape, kMaxShapes> shapes_;  // [0, count_) written once each, before count_ counts them
  std::array<int64_t, kMaxShapes> caps_{};
  std::atomic<size_t> count_{0};
  mutable std::mutex mu_;  // choose() and reports_
  std::vector<Report> reports_;
};

}  // namespace ember::cpu
