// What the CPU kernels for claimed groups (matmul_kernel.cpp, conv_kernel.cpp) share: the check that decides
// whether packed weights are still good, the post-op list for oneDNN, and the same epilogue through ATen.
#pragma once

#include "kernels/cpu/onednn.h"
#include "kernels/epilogue_group.h"

#include <ATen/ATen.h>

#include <mutex>
#include <vector>

namespace ember::cpu {

// The process-wide number of (input, its version, the weights view's data pointer, sizes and strides), the same
// for every caller while the input lives (kernels/cpu/matmul_kernel.cpp). Called when a kernel's packing changes,
// not per call.
uint64_t weights_generation(const at::Tensor& input, uint32_t version, const at::Tensor& w);

// Which packing of the weights a call may use: 0 (read them where they lie) until the same unmodified graph
// input comes a second time, seen through the same view; then one generation number until it changes.
// first_sight() is true until the first call: it runs through ATen, so that an inference graph makes only
// the primitives for packed weights (oneDNN generates code per primitive, a few ms each), on its second call.
// "Same" is the same TensorImpl and version counter (an in-place write moves it), the weights view at the
// same data pointer, sizes and strides. The input is kept alive so that no other tensor can take its
// address while its packing is trusted. Inference tensors have no version counter: never packed.
// Generation numbers are process-wide (weights_generation): kernels that read the same weights through the same
// view name them alike, so they share one packed copy (kernels/cpu/onednn.cpp).
class WeightsPacking {
 public:
  bool first_sight() const {
    std::lock_guard<std::mutex> lock(mu_);
    return !seen_;
  }

  uint64_t generation(const at::Tensor& input, const at::Tensor& w) const {
    std::lock_guard<std::mutex> lock(mu_);
    seen_ = true;
    if (input.is_inference() || !input.has_storage()) {
      input_ = at::Tensor();
      return 0;
    }
    uint32_t version = input._version();
    bool same = input_.defined() && input_.unsafeGetTensorImpl() == input.unsafeGetTensorImpl() &&
                version_ == version && data_ == w.data_ptr() && w.strides().equals(strides_) &&
                w.sizes().equals(sizes_);
    if (!same) {
      input_ = input;
      version_ = version;
      data_ = w.data_ptr();
      strides_ = w.strides().vec();
      sizes_ = w.sizes().vec();
      generation_ = 0;
      return 0;
    }
    if (generation_ == 0) generation_ = weights_generation(input, version, w);
    return generation_;
  }

 private:
  mutable std::mutex mu_;
  mutable at::Tensor input_;
  mutable uint32_t version_ = 0;
  mutable const void* data_ = nullptr;
  mutable std::vector<int64_t> strides_, sizes_;
  mutable uint64_t generation_ = 0;
  mutable bool seen_ = false;
};

inline onednn::DType onednn_dtype(c10::ScalarType t) {
  return t == c10::kBFloat16 ? onednn::DType::BF16 : onednn::DType::F32;
}

// How many of the epilogue's leading ops a oneDNN post-op chain (ember's or torch's own) computes as ATen
// does, NaN included: those before the first relu. oneDNN's relu is max(x, 0), which maps NaN to 0 where
// torch.relu keeps it, and it has no other form that keeps NaN (its clip and binary max are the same max;
// a negative slope of -0.0 takes the same code). So a relu and what follows it run through ATen, in place
// on the library's result (apply_epilogue_with_aten from this index): one more pass over the result.
// oneDNN's convolutions also map NaN to 0 through a sigmoid (its exp clamps the input first): Debian's 2.6
// always, torch 2.13's own where the convolution pads (their matmuls, and ATen's sigmoid, keep NaN). There a
// sigmoid stops the chain too, and so does a clamp (relu6), which oneDNN's clip maps NaN to its lower bound.
// A second scale-and-shift (eltwise_linear) stops it as well: Debian's oneDNN 2.6 applied the first one's alpha
// and beta again in its place (x * 0.5, tanh, * 3 came out as tanh(x * 0.5) * 0.5; fuzz seed 1943321). Adjacent
// scales are one op by then (lowering merges them).
inline size_t library_exact_ops(const EpilogueGroup& g) {
  size_t i = 0, linears = 0;
  for (; i < g.ops.size(); ++i) {
    const EpilogueOp::Kind k = g.ops[i].kind;
    if (k == EpilogueOp::Kind::Relu || k == EpilogueOp::Kind::Clamp || (k == EpilogueOp::Kind::Sigmoid && g.kind == EpilogueGroup::Kind::Conv2d)) break;
    if (k == EpilogueOp::Kind::Linear && linears++) break;
  }
  return i;
}

// The post-ops of g.ops[0, count).
inline std::vector<onednn::PostOp> post_ops_of(const EpilogueGroup& g, size_t count) {
  std::vector<onednn::PostOp> out;
  size_t a = 0;
  for (size_t i = 0; i < count; ++i) {
    const EpilogueOp& op = g.ops[i];
    onednn::PostOp p;
    switch (op.kind) {
      case EpilogueOp::Kind::Relu: p.kind = onednn::PostOp::Kind::Relu; break;
      case EpilogueOp::Kind::GeluErf: p.kind = onednn::PostOp::Kind::GeluErf; break;
      case EpilogueOp::Kind::GeluTanh: p.kind = onednn::PostOp::Kind::GeluTanh; break;
      case EpilogueOp::Kind::Silu: p.kind = onednn::PostOp::Kind::Silu; break;
      case EpilogueOp::Kind::Sigmoid: p.kind = onednn::PostOp::Kind::Sigmoid; break;
      case EpilogueOp::Kind::Tanh: p.kind = onednn::PostOp::Kind::Tanh; break;
      case EpilogueOp::Kind::Hardswish: p.kind = onednn::PostOp::Kind::Hardswish; break;
      case EpilogueOp::Kind::Clamp: p.kind = onednn::PostOp::Kind::Clamp; break;
      case EpilogueOp::Kind::Linear: p.kind = onednn::PostOp::Kind::Linear; break;
      case EpilogueOp::Kind::Add: p.kind = onednn::PostOp::Kind::Add; p.row = g.addend_is_row[a++]; break;
      case EpilogueOp::Kind::View: continue;  // (lowering leaves none)
    }
    p.alpha = op.alpha;
    p.beta = op.beta;
    out.push_back(p);
  }
  return out;
}

// The name torch's own oneDNN ops (mkldnn::_convolution_pointwise, mkldnn::_linear_pointwise) give an
// activation as their post-op, with GELU's algorithm in *algorithm (else null); null where `kind` is none,
// or relu, which their oneDNN applies as max(x, 0), NaN to 0 (library_exact_ops).
inline const char* torch_activation(EpilogueOp::Kind kind, const char** algorithm) {
  *algorithm = nullptr;
  switch (kind) {
    case EpilogueOp::Kind::GeluErf: *algorithm = "none"; return "gelu";
    case EpilogueOp::Kind::GeluTanh: *algorithm = "tanh"; return "gelu";
    case EpilogueOp::Kind::Silu: return "swish";
    case EpilogueOp::Kind::Sigmoid: return "sigmoid";
    case EpilogueOp::Kind::Tanh: return "tanh";
    case EpilogueOp::Kind::Hardswish: return "hardswish";
    default: return nullptr;
  }
}

// What a claimed group's kernel reads first, in EpilogueGroup::reads() order: src, weights, bias (when the
// group has one), the addends. *next is left at the reads that follow (a matmul's shape values, then
// weights_input).
struct GroupOperands {
  const at::Tensor* src = nullptr;
  const at::Tensor* weights = nullptr;
  at::Tensor bias;
  std::vector<at::Tensor> addends;
};

inline GroupOperands read_operands(const std::vector<c10::IValue>& buffers, const std::vector<uint32_t>& reads,
                                   bool bias, size_t addends, size_t* next) {
  size_t r = 0;
  GroupOperands g;
  g.src = &buffers[reads[r++]].toTensor();
  g.weights = &buffers[reads[r++]].toTensor();
  if (bias) g.bias = buffers[reads[r++]].toTensor();
  g.addends.reserve(addends);
  for (size_t i = 0; i < addends; ++i) g.addends.push_back(buffers[reads[r++]].toTensor());
  *next = r;
  return g;
}

// ATen's error with the node named, as the executor does for ATen steps: the user's way back to their code.
[[noreturn]] inline void rethrow_naming(const c10::Error& e, const std::string& where) {
  throw std::runtime_error(std::string(e.what_without_backtrace()) + "\n(ember: while running " + where + ")");
}

// The epilogue through ATen, in place on y where ATen has the op in place; from ops[first] on, where a library
// call applied the ones before.
inline at::Tensor apply_epilogue_with_aten(at::Tensor y, const std::vector<EpilogueOp>& ops,
                                           const std::vector<at::Tensor>& addends, const std::vector<bool>& is_row,
                                           size_t first = 0) {
  size_t a = 0;
  for (size_t i = 0; i < first; ++i) a += ops[i].kind == EpilogueOp::Kind::Add;
  for (size_t i = first; i < ops.size(); ++i) {
    const EpilogueOp& op = ops[i];
    switch (op.kind) {
      case EpilogueOp::Kind::Relu: y.relu_(); break;
      case EpilogueOp::Kind::GeluErf: y = at::gelu(y); break;
      case EpilogueOp::Kind::GeluTanh: y = at::gelu(y, "tanh"); break;
      case EpilogueOp::Kind::Silu: y = at::silu(y); break;
      case EpilogueOp::Kind::Sigmoid: y.sigmoid_(); break;
      case EpilogueOp::Kind::Tanh: y.tanh_(); break;
      case EpilogueOp::Kind::Hardswish: y = at::hardswish_(y); break;
      case EpilogueOp::Kind::Clamp: y.clamp_(op.alpha, op.beta); break;
      case EpilogueOp::Kind::Linear: y.mul_(op.alpha).add_(op.beta); break;
      case EpilogueOp::Kind::Add:
        y.add_(is_row[a] ? addends[a].reshape({-1}) : addends[a].reshape(y.sizes()));
        ++a;
        break;
      case EpilogueOp::Kind::View: break;
    }
  }
  return y;
}

}  // namespace ember::cpu
