// The host side of one call of a fused CUDA kernel, apart from the driver so that it runs (and is
// tested) without a GPU: the Params words, the outputs, which entry point, and the grid. Choices:
//  - flat groups take the 16-byte vector kernel when outputs are aligned; inside it each input gets
//    vector loads where contiguous and aligned (or contiguous within a repeating period: a bias), a
//    single load where it is one value, strided loads otherwise;
//  - row groups take the register-resident variant for their row length that the function's
//    registers allow (cuda_source.h), else the general kernel; full inputs get vector loads where rows
//    are contiguous and aligned;
//  - grids fill the device (limits.max_blocks), grid-stride loops do the rest.
#pragma once

#include "kernels/cuda/cuda_source.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace ember::cuda {

struct LaunchLimits {
  int64_t max_blocks = 1;                 // blocks that fill the device
  std::vector<int64_t> row_max_threads;   // per row variant of the source: its largest block
};

struct CallPlan {
  std::vector<int64_t> params;       // the Params struct, word by word
  std::vector<at::Tensor> outputs;   // allocated on the device given
  bool launch = false;               // false: nothing to compute
  size_t entry = 0;                  // 0: the general kernel; 1: the vector kernel (flat) or row variant 0, ...
  unsigned blocks = 1, threads = 1;
};

// `out_dtypes`: the program's output dtypes (its Values may be gone by run time).
CallPlan plan_call(const Program& program, const CudaSource& source, const std::vector<c10::ScalarType>& out_dtypes,
                   const std::vector<c10::IValue>& buffers, const std::vector<uint32_t>& reads, c10::Device device,
                   const LaunchLimits& limits);

}  // namespace ember::cuda
