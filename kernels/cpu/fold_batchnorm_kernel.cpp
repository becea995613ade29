// ember::fold_batchnorm (made by passes/fold_batchnorm.cpp): a convolution's weights and bias with an eval-mode
// batch norm folded in.
//  1. The op is registered with the dispatcher, so a graph holding it runs anywhere (uncached) through its
//     OperatorHandle, like any ATen op.
//  2. Its kernel computes the folded tensors once and hands back the same tensors on every later call while
//     every input is the same unmodified tensor (TensorImpl, version counter, data pointer): the
//     convolution after it then sees weights that stay put and packs them once. Inputs are kept alive, so
//     no other tensor can take their address while the cache trusts it. Inference tensors have no version
//     counter: with any among the inputs, the fold is recomputed on every call.
//  3. The folded tensors are made outside inference mode (they need a version counter of their own for the
//     convolution's packing check), computed in float32, the weights with the weights' own strides and dtype
//     and the bias in that dtype too (the IR's types for them).
#include "kernels/cpu/cpu_kernel.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <array>
#include <mutex>

namespace ember::cpu {
namespace {

std::tuple<at::Tensor, at::Tensor> fold(const at::Tensor& weights, const std::optional<at::Tensor>& bias,
                                        const std::optional<at::Tensor>& gamma, const std::optional<at::Tensor>& beta,
                                        const at::Tensor& mean, const at::Tensor& var, double eps) {
  // In float32 whatever the parameters' dtype; the results are rounded once, to the weights' dtype.
  auto f32 = [](const at::Tensor& t) { return t.to(at::kFloat); };
  at::Tensor scale = at::rsqrt(f32(var) + eps);
  if (gamma && gamma->defined()) scale = scale * f32(*gamma);
  std::vector<int64_t> channel_shape(weights.dim(), 1);
  channel_shape[0] = -1;
  at::Tensor folded_weights = at::empty_strided(weights.sizes(), weights.strides(), weights.options());
  at::mul_out(folded_weights, weights, scale.view(channel_shape));
  at::Tensor shifted = bias && bias->defined() ? f32(*bias) - f32(mean) : -f32(mean);
  at::Tensor folded_bias = shifted * scale;
  if (beta && beta->defined()) folded_bias = folded_bias + f32(*beta);
  return {folded_weights, folded_bias.to(weights.scalar_type()).contiguous()};
}

TORCH_LIBRARY_FRAGMENT(ember, m) {
  m.def("fold_batchnorm(Tensor weight, Tensor? bias, Tensor? gamma, Tensor? beta, Tensor mean, Tensor var, "
        "float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(ember, CompositeExplicitAutograd, m) { m.impl("fold_batchnorm", &fold); }

class FoldBatchNormKernel final : public Kernel {
 public:
  // present[i]: whether argument i (weights, bias, gamma, beta, mean, var) is a tensor rather than None; the
  // kernel reads the present ones, in that order.
  FoldBatchNormKernel(std::array<bool, 6> present, double eps) : present_(present), eps_(eps) {}

  void run(std::vector<c10::IValue>& buffers, const std::vector<uint32_t>& reads,
           const std::vector<uint32_t>& writes) const override {
    std::lock_guard<std::mutex> lock(mu_);
    bool same = seen_.size() == reads.size();
    for (size_t i = 0; same && i < reads.size(); ++i) same = unchanged(seen_[i], buffers[reads[i]].toTensor());
    if (!same) refold(buffers, reads);
    buffers[writes[0]] = weights_;
    buffers[writes[1]] = bias_;
  }

  std::string describe() const override { return "fold_batchnorm"; }

 private:
  struct Seen {
    at::Tensor tensor;  // kept alive: no other tensor can take its address
    uint32_t version = 0;
    const void* data = nullptr;
  };

  static bool unchanged(const Seen& s, const at::Tensor& t) {
    return t.unsafeGetTensorImpl() == s.tensor.unsafeGetTensorImpl() && t._version() == s.version &&
           t.data_ptr() == s.data;
  }

  void refold(const std::vector<c10::IValue>& buffers, const std::vector<uint32_t>& reads) const {
    std::array<std::optional<at::Tensor>, 6> args;
    bool cacheable = true;
    seen_.clear();
    for (size_t i = 0, r = 0; i < args.size(); ++i) {
      if (!present_[i]) continue;
      const at::Tensor& t = buffers[reads[r++]].toTensor();
      args[i] = t;
      cacheable = cacheable && !t.is_inference() && t.has_storage();
      if (cacheable) seen_.push_back(Seen{t, t._version(), t.data_ptr()});
    }
    c10::InferenceMode not_inference(false);
    // The guard above re-includes the autograd keys; the plan runs below them (parameters require grad).
    c10::impl::ExcludeDispatchKeyGuard below_autograd(c10::autograd_dispatch_keyset_with_ADInplaceOrView);
    std::tie(weights_, bias_) = fold(*args[0], args[1], args[2], args[3], *args[4], *args[5], eps_);
    if (!cacheable) seen_.clear();  // never matches: the next call folds again
  }

  std::array<bool, 6> present_;
  double eps_;
  mutable std::mutex mu_;
  mutable std::vector<Seen> seen_;
  mutable at::Tensor weights_, bias_;
};

}  // namespace

std::shared_ptr<const Kernel> make_fold_batchnorm_kernel(const Node& fold, std::string* why_not) {
  if (fold.op != "ember::fold_batchnorm" || fold.args.size() != 7 || fold.outputs.size() != 2 ||
      (fold.args[6].kind != Arg::Kind::Float && fold.args[6].kind != Arg::Kind::Int)) {
    if (why_not) *why_not = "not an ember::fold_batchnorm node";
    return nullptr;
  }
  std::array<bool, 6> present;
  for (size_t i = 0; i < present.size(); ++i) {
    present[i] = fold.args[i].is_value();
    if (!present[i] && fold.args[i].kind != Arg::Kind::None) {
      if (why_not) *why_not = "ember::fold_batchnorm with a literal tensor argument";
      return nullptr;
    }
  }
  if (!present[0] || !present[4] || !present[5]) {
    if (why_not) *why_not = "ember::fold_batchnorm without weights, mean or var";
    return nullptr;
  }
  double eps = fold.args[6].kind == Arg::Kind::Float ? fold.args[6].f : static_cast<double>(fold.args[6].i);
  return std::make_shared<FoldBatchNormKernel>(present, eps);
}

}  // namespace ember::cpu
