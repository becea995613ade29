// A claimed matmul or convolution group (passes/matmul_epilogue.cpp) lowered for a library call: operands,
// the epilogue steps in order, and the shape of the value it writes. Device-neutral: kernels/cpu turns it
// into a oneDNN primitive with post-ops; a GPU generator could turn a matmul into a cuBLASLt call with an
// epilogue.
#pragma once

#include "ember/epilogue.h"
#include "ember/ir.h"

#include <optional>
#include <string>
#include <vector>

namespace ember {

struct EpilogueGroup {
  enum class Kind : uint8_t { Matmul, Conv2d };
  Kind kind = Kind::Matmul;
  int group = -1;
  c10::Device device{c10::kCPU};
  c10::ScalarType dtype = c10::kFloat;
  const Value* src = nullptr;      // matmul: [M, K]; conv: [N, C, H, W]
  const Value* weights = nullptr;  // matmul: [K, N], any strides; conv: [OC, C / groups, KH, KW]
  const Value* bias = nullptr;     // [N] / [OC], or null
  int64_t stride[2] = {1, 1}, padding[2] = {0, 0}, dilation[2] = {1, 1}, groups = 1;  // conv
  std::vector<EpilogueOp> ops;     // in order; no views (they do not change the values)
  std::vector<const Value*> addends;    // the Add steps' tensors, in order
  std::vector<bool> addend_is_row;      // per addend: one row broadcast over the result
  // Where the group ends in a view: the shape it writes, each dimension a constant or a value read per
  // call (a SymInt). Empty: the matmul's own [M, N].
  std::vector<std::pair<int64_t, const Value*>> out_shape;
  const Value* output = nullptr;
  // The graph input the weights are (or are a transposing view of): a parameter, whose identity and
  // version counter say whether packed weights are still good. Views made while the plan runs (below
  // autograd) get their own version counter, so the check reads the input itself. Null: never packed.
  const Value* weights_input = nullptr;
  std::vector<const Node*> members;

  // The values the kernel reads, in the order it reads them: src, weights, bias?, addends, shape values,
  // weights_input?
  std::vector<const Value*> reads() const;
  // "matmul f32 +bias relu add" for listings and explain.
  std::string text() const;
};

// True when `group`'s first node is a matmul or a convolution: it was claimed with its epilogue, not fused.
bool is_epilogue_group(const Graph& graph, int group);

// Nothing, with the reason in *why_not, when the group is not a matmul chain as the pass claims them.
// `unversioned`: per graph input, whether its version counter may miss a change (CompileOptions): such
// weights are never packed.
std::optional<EpilogueGroup> lower_epilogue_group(const Graph& graph, int group, std::string* why_not,
                                                  const std::vector<bool>& unversioned = {});

}  // namespace ember
