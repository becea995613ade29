// The arguments of an aten::max_pool2d_with_indices step as the max-pool fast paths take them
// (kernels/cpu/pool.cpp, and kernels/cuda/pool.cpp where nothing reads the indices).
#pragma once

#include "ember/runtime.h"

#include <optional>

namespace ember {

struct MaxPoolArgs {
  uint32_t input = 0, output = 0;  // buffers
  int32_t indices = -1;            // the indices' buffer, or -1 where nothing reads them
  int kh = 1, kw = 1, sh = 1, sw = 1, ph = 0, pw = 0;
};

// The step's pooling when it is one a fast path can run: a 4-D input on CUDA (cuda) or not, no dilation or
// ceil_mode, windows of at most 64, padding at most half the window. Otherwise nothing. Indices dropped or
// freed by this very step count as unread (-1).
std::optional<MaxPoolArgs> max_pool_args(const Node& n, const Step& step, bool cuda);

}  // namespace ember
