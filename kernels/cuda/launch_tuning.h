// max-autotune's launch tuning of fused CUDA kernels (issue #61): at a call shape's first call, each launch the
// call may take (call_plan.h: launch_candidates: block size, grid, row variant or general kernel, a column group's
// chunks) is timed on the call's own buffers and the fastest kept for that kernel and shape.
//  1. Only under Tuning::exhaustive (mode="max-autotune", options={"autotune": True}); the default mode's kernels
//     carry no tuner and launch exactly as plan_call says (cuda_kernel.cpp keeps the two apart).
//  2. Timing: time_runs of kernels/cuda/timing.cpp (the GEMMs' own: CUDA events, the L2 cleared before each run,
//     the median of several), registered here at load time in builds against a CUDA torch; without it nothing
//     is tuned. Fused kernels read their inputs and write outputs plan_call has just allocated, so the timed runs
//     write the call's own outputs and the call's launch, made last with the winner, leaves them as it would.
//  3. The winner: the fastest, where at least kMinGain faster than plan_call's launch (else plan_call's: the
//     choice does not flip between processes on noise). The wall time of the timing (and of compiling the row
//     groups' general entry for it) is charged to the graph's TuningBudget; once spent, shapes met later keep
//     plan_call's launch and the one being timed keeps its best so far (not written to disk).
//  4. Per call: find() compares the call's shape (numel, rows, cols, entry, access masks: what plan_call chose
//     from) with those timed, a handful of integers each, without a lock. Up to kMaxShapes shapes per kernel are
//     timed: a static graph has one; a symbolic one times each size it meets (serving sees few) up to that many,
//     then launches as plan_call says.
//  5. Each timed choice goes to <cache dir>/launch (launch_record.h), keyed by ember's version, the device, the
//     source's hash and the shape; a later process reads it instead of timing, and uses it only where it is one
//     of the call's own candidates.
#pragma once

#include "ember/runtime.h"
#include "kernels/cuda/call_plan.h"

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace ember::cuda {

// The GPU timing the tuner needs (kernels/cuda/timing.cpp registers it where the CUDA runtime is linked).
struct LaunchTimer {
  // Milliseconds per run of `launch` on `stream`, each run after `flush` (flush_bytes) is overwritten; negative
  // where it cannot run; a first run over `give_up_ms` (when >= 0) is not repeated.
  float (*time_runs)(const std::function<bool()>& launch, void* stream, void* flush, size_t flush_bytes,
                     float give_up_ms) = nullptr;
  int64_t (*flush_bytes)(int device) = nullptr;          // twice the device's L2
  std::string (*device_identity)(int device) = nullptr;  // "NVIDIA H100 80GB HBM3 sm_90 132 SMs"; "": unknown
};
void register_launch_timer(const LaunchTimer& timer);
const LaunchTimer* launch_timer();  // null where none is registered

class LaunchTuner {
 public:
  static constexpr size_t kMaxShapes = 8;
  static constexpr float kMinGain = 0.03f;

  LaunchTuner(Tuning tuning, const Program& program, const CudaSource& source, int device);

  // The launch chosen for `plan`'s call shape, or null (none chosen yet).
  const LaunchChoice* find(const CallPlan& plan) const {
    const size_t n = count_.load(std::memory_order_acquire);
    for (size_t i = 0; i < n; ++i)
      if (shapes_[i].matches(plan)) return &shapes_[i].choice;
    return nullptr;
  }
  // No more shapes are chosen for: calls of new shapes launch as plan_call says.
  bool full() const { return count_.load(std::memory_order_acquire) == kMaxShapes; }

  // Chooses the launch of `plan`'s shape (not on a stream being captured: null then): from disk where an earlier
  // process timed it, plan_call's where the budget is spent, else by timing `candidates()` (plan's own first;
  // the call may compile entries for them) through `launch`, which runs the call as the candidate on `stream`.
  const LaunchChoice* choose(const CallPlan& plan, const std::function<std::vector<LaunchChoice>()>& candidates,
                             const std::function<bool(const LaunchChoice&)>& launch, void* stream);

  // ember.explain's lines: per shape chosen for, the winner, plan_call's launch and the candidates' times.
  std::vector<std::string> lines() const;

 private:
  struct Shape {
    int64_t numel = 0, rows = 0, cols = 0;
    size_t entry = 0;
    uint32_t masks[4] = {0, 0, 0, 0};
    LaunchChoice choice;
    bool matches(const CallPlan& p) const {
      return p.numel == numel && p.rows == rows && p.cols == cols && p.entry == entry && p.masks[0] == masks[0] &&
             p.masks[1] == masks[1] && p.masks[2] == masks[2] && p.masks[3] == masks[3];
    }
  };
  struct Report {
    std::string shape, winner, plan_call, how;  // how: "max-autotune", "from disk", "default: budget spent", ...
    std::vector<std::pair<std::string, float>> timings;
  };
  const LaunchChoice* keep(const CallPlan& plan, const LaunchChoice& choice, Report report);
  std::string record_key(const CallPlan& plan);

  const Tuning tuning_;
  const Program& program_;      // the kernel's, which outlives its tuner
  const CudaSource& source_;
  const int device_;
  const std::string source_hash_;
  std::array<Shape, kMaxShapes> shapes_;  // [0, count_) written once each, before count_ counts them
  std::atomic<size_t> count_{0};
  mutable std::mutex mu_;                 // choose() and reports_
  std::vector<Report> reports_;
};

}  // namespace ember::cuda
