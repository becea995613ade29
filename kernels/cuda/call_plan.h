// The host side of one call of a fused CUDA kernel, apart from the driver so that it runs (and is
// tested) without a GPU: the Params words, the outputs, which entry point, and the grid. Choices:
//  - flat groups take the 16-byte vector kernel when outputs are aligned; inside it each input gets
//    vector loads where contiguous and aligned (or contiguous within a repeating period: a bias), a
//    single load where it is one value; the strided vector entry where some input needs its strides;
//  - row groups take the register-resident variant for their row length that the function's
//    registers allow (cuda_source.h), else the general kernel; full inputs get vector loads where rows
//    are contiguous and aligned;
//  - column groups (Program::outer) take their one entry, a block per tile of 32 columns and chunk of
//    rows: where the tiles alone would leave the device idle (a bias gradient's 768 columns make 24),
//    the rows split into chunks of at least kColumnChunkRows over blockIdx.y, up to one wave in all,
//    and each chunk's results go to a workspace the launcher provides (CallPlan::workspace_floats,
//    ::counters); a column input's strides are aligned to the kept shape and stored at the kept dims;
//  - flat grids take every block their work fills (each thread's U vectors once): on an H200, x * sigmoid(x)
//    + y over 64M f32 ran 189 us this way against 218 us in one wave of persistent blocks with grid-stride loops
//    (a standalone copy of the kernel's shape; 128 us for cudaMemcpy's 512 MB);
//  - row and column grids are at most one wave: the blocks of the chosen size that every multiprocessor
//    holds at once for that entry point (LaunchLimits::wave), and grid-stride loops do the rest. A grid
//    of SMs * 8 blocks ran a full wave and then a partial one wherever registers allowed fewer than 8
//    resident blocks, leaving SMs idle for the second; a single wave of persistent blocks keeps every
//    SM busy to the end.
//  - under max-autotune the launch is timed instead (launch_candidates below; kernels/cuda/launch_tuning.h):
//    every configuration the entry points take without recompiling, each computing the same result.
#pragma once

#include "kernels/cuda/cuda_source.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace ember::cuda {

// What the device allows each entry point, queried once when the kernel is loaded (cuda_kernel.cpp).
struct LaunchLimits {
  int64_t multiprocessors = 1;
  // Per entry point, in the order of CallPlan::entry: its largest block, and the blocks of 32 * (i + 1)
  // threads one multiprocessor holds at once (resident[entry][i]; 0: not launchable). Empty: unknown.
  std::vector<int64_t> max_threads;
  std::vector<std::vector<int>> resident;

  // The largest block `entry` launches with (1024 where unknown).
  int64_t most_threads(size_t entry) const { return entry < max_threads.size() ? max_threads[entry] : 1024; }
  // Blocks of `threads` threads of `entry` that fill the device once: one full wave.
  int64_t wave(size_t entry, unsigned threads) const;
};

struct CallPlan {
  std::vector<int64_t> params;       // the Params struct, word by word
  std::vector<at::Tensor> outputs;   // allocated on the device given
  bool launch = false;               // false: nothing to compute
  size_t entry = 0;                  // 0: the general kernel; 1: the vector kernel (flat) or row variant 0, ...
  unsigned blocks = 1, threads = 1;
  // Column groups whose rows split (splits > 1, the grid's y): the workspace the kernel needs, floats for
  // the chunks' results (Params::part) and zeroed counters, one per tile of 32 columns (Params::count,
  // back to zero when the kernel ends); their pointers go to params[workspace_word] and the word after
  // (set_workspace).
  unsigned splits = 1;
  int64_t workspace_floats = 0, counters = 0;
  size_t workspace_word = 0;
  // What the launch was chosen from (the Params' numel, rows and cols words and its access masks: vec,
  // bcast, inner, chan): max-autotune keys its timed launches by them (launch_tuning.h).
  int64_t numel = 0, rows = 0, cols = 0;
  uint32_t masks[4] = {0, 0, 0, 0};
};

// One launch configuration of a call: plan_call's own, or one timed in its place under max-autotune. Resolved for
// the call's sizes (blocks, splits), so it applies only to calls with the sizes it was made for.
struct LaunchChoice {
  uint32_t entry = 0, threads = 0, blocks = 0, splits = 1;
  bool operator==(const LaunchChoice&) const = default;
};
inline LaunchChoice launch_of(const CallPlan& plan) { return {static_cast<uint32_t>(plan.entry), plan.threads, plan.blocks, plan.splits}; }

// The launches `plan` (plan_call's, with launch set) may take instead, its own first, no two alike; each computes
// the same result. The threads per block (64 to 1024, as each entry allows) and the grid (one wave of resident
// blocks, or every block the work fills) are launch arguments; which loads are vector loads, and the vectors
// per thread of the flat and row entries (flat_unroll, RowVariant::chunks), are compiled in.
//  - flat groups: plan's entry (its loads follow from the pointers), every block size, both grids;
//  - row groups: each compiled register-resident variant that takes rows of this length and the general
//    kernel, with every block size (a block variant: the one its rows need), both grids;
//  - column groups: blocks of kColumnThreads (the kernel is printed for it), the rows in plan's chunks, in
//    half or twice as many, or unsplit; unsplit, one wave of tiles or all of them.
// Entries `limits` does not know (not compiled yet) are left out, plan's own aside.
std::vector<LaunchChoice> launch_candidates(const CallPlan& plan, const Program& program, const CudaSource& source,
                                            const LaunchLimits& limits);

// `plan` made to launch as `choice`, one of its launch_candidates: entry, grid, and a column group's chunks of
// rows with the workspace they need.
void apply_launch(CallPlan& plan, const LaunchChoice& choice, const CudaSource& source);

// A short name for `choice` of a kernel from `source` ("w4 256t 528b", "general 512t 1024b", "vec 128t 8192b",
// "cols 256t 24b 16s"), for ember.explain.
std::string launch_name(const LaunchChoice& choice, const Program& program, const CudaSource& source);

// Writes the workspace pointers of a column group's call into its Params.
void set_workspace(CallPlan& plan, float* part, unsigned* count);

// Rows a column group's chunk takes at least (8 per warp): fewer, and combining the chunks costs more
// than it spreads.
constexpr int64_t kColumnChunkRows = 64;

// `out_dtypes`: the program's output dtypes (its Values may be gone by run time).
CallPlan plan_call(const Program& program, const CudaSource& source, const std::vector<c10::ScalarType>& out_dtypes,
                   const std::vector<c10::IValue>& buffers, const std::vector<uint32_t>& reads, c10::Device device,
                   const LaunchLimits& limits);

}  // namespace ember::cuda
