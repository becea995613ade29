// The iteration space of a fused kernel at run time, shared by the CPU and CUDA generators: the full
// shape is the broadcast of every input read in full, and each input is seen through strides aligned
// to that shape (or to the row shape), 0 where it broadcasts.
#pragma once

#include "kernels/program.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace ember {

// Broadcast of the full-role inputs' shapes, padded to the program's rank. Throws if they do not
// broadcast.
std::vector<int64_t> full_shape(const Program& program, const std::vector<c10::IValue>& buffers,
                                const std::vector<uint32_t>& reads);

// One call's iteration space: the full shape; for groups with reductions, rows (the full shape without
// its last dimension) of `cols` elements; for flat groups one row of all `numel` elements. For column
// groups (Program::outer), row_shape is the kept shape (the full shape without its `outer` leading
// dims), `rows` its element count (the reduced values) and `cols` the reduction's length.
struct IterationSpace {
  std::vector<int64_t> full;
  std::vector<int64_t> row_shape;
  int64_t numel = 1, rows = 1, cols = 1;
};
IterationSpace iteration_space(const Program& program, const std::vector<c10::IValue>& buffers,
                               const std::vector<uint32_t>& reads);

// Strides of `t` aligned to the trailing dimensions of `space` (a keepdim [..., 1] row input drops
// its last dimension; with `trailing`, a tensor of higher rank drops its leading dims instead, as a
// column group's keepdim [1, ..., kept] input does); 0 where `t` broadcasts. `out` gets space.size() entries.
void aligned_strides(const at::Tensor& t, const std::vector<int64_t>& space, int64_t* out, bool trailing = false);

// Shapes of the outputs for a given full shape: full, or the row shape (with a trailing 1 if keepdim).
std::vector<int64_t> output_shape(const ProgramOutput& o, const std::vector<int64_t>& full, bool has_reduction,
                                  size_t outer = 0);

}  // namespace ember
