// Matmul epilogues: the pointwise steps a library matmul can apply to its result before writing it
// (oneDNN post-ops on the CPU, cuBLASLt epilogues on the GPU). One classifier, read by the pass that claims
// epilogues (passes/matmul_epilogue.cpp) and by the kernel generators that lower them, so both agree on
// what each op means.
#pragma once

#include "ember/ir.h"

#include <optional>
#include <vector>

namespace ember {

struct EpilogueOp {
  enum class Kind : uint8_t { Relu, GeluErf, GeluTanh, Silu, Sigmoid, Tanh, Hardswish, Clamp, Linear, Add, View };
  Kind kind = Kind::Relu;
  float alpha = 1.f, beta = 0.f;  // Linear: alpha * x + beta; Clamp: the bounds [alpha, beta] (relu6: [0, 6])
  const Value* addend = nullptr;  // Add: the tensor added (a residual, or one row broadcast over all rows)
};

// What node `n` does to its tensor input `in` as one epilogue step, or nothing when it is not one (another
// op, `in` in an unsupported position, an alpha other than 1 on an added tensor, a value-dependent scale).
// Shapes and dtypes are the caller's to check.
std::optional<EpilogueOp> as_epilogue(const Node& n, const Value* in);

// aten::mm(a, b) and aten::addmm(bias, a, b) with beta = alpha = 1: the matmuls an epilogue can follow.
// Sets *src, *weights and *bias (null for mm) when it is one.
bool as_matmul(const Node& n, const Value** src, const Value** weights, const Value** bias);

// aten::convolution in 2-D (4-D tensors), not transposed: the other op an epilogue can follow.
bool as_conv2d(const Node& n, const Value** src, const Value** weights, const Value** bias);

// Whether a convolution followed by `ops` is one call of torch's own oneDNN convolution with post-ops
// (mkldnn::_convolution_pointwise, kernels/cpu/conv_kernel.cpp): no op, one activation (relu, gelu, silu,
// sigmoid, tanh, hardswish, a clamp), or an added tensor of the result's shape, then relu or nothing (a relu or a clamp is then
// applied through ATen after the call: kernels/cpu/epilogue_support.h, library_exact_ops).
bool torch_conv_takes(const std::vector<EpilogueOp>& ops);
// EMBER_ONEDNN_CONV=1: convolutions go to ember's own (Debian's) oneDNN with any epilogue instead of torch's
// call. Read at each compile, so that a process can compare both; the claim pass and the kernel read it here.
bool onednn_convolutions_requested();
// The graph input behind `v`: v itself, or what a chain of transposing views (permute / t / transpose)
// starts from. That is how AOTAutograd passes a Linear's weights, which stay the same tensor call after
// call in inference; or weights with a batch norm folded in (ember::fold_batchnorm's first output), which its
// kernel hands back unchanged while the parameters are. Null when `v` is computed otherwise.
const Value* input_behind(const Value* v);

}  // namespace ember
