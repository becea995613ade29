// The CPU kernel for a claimed 2-D convolution group (passes/matmul_epilogue.cpp, item 5), through one of
// two libraries, with ATen for what neither takes.
// By default: torch's own oneDNN convolution with the epilogue as post-ops, the op
// inductor's CPU backend calls (mkldnn::_convolution_pointwise, and its .binary form for a residual add),
// through the dispatcher, so no second oneDNN is involved. A relu or a sigmoid is ATen's, in place on the call's
// result: torch's relu post-op maps NaN to 0, and its sigmoid does where the convolution pads
// (epilogue_support.h, library_exact_ops).
//  1. Weights that are a parameter coming back unmodified (WeightsPacking) are reordered once into the
//     blocked layout oneDNN prefers for the call's input (mkldnn::_reorder_convolution_weight), for
//     channels-last sources: ATen's convolution reorders them on every call, which is most of a call where
//     the weights outweigh the activations. 2-core AVX-512 host, batch 1, channels-last, ms per call, ATen's
//     convolution + relu / the fused call / the fused call on packed weights: 1x1 512->2048 at 7x7
//     1.48 / 1.27 / 0.55; 3x3 64->64 at 56x56 1.23 / 1.29 / 1.15; 3x3 128->128 at 28x28 1.19 / 1.29 / 1.16.
//     Whole models through ember, speedup over eager (same host, EMBER_CPU_CONV=aten against this):
//     resnet50 b1 channels-last 1.08-1.13x -> 1.56-1.58x, resnet18 b2 NCHW 1.10-1.17x -> 1.33-1.35x.
//  2. The result takes the source's layout, which is eager's where source and weights agree (both
//     channels-last or both contiguous), and where a channels-last source meets packed weights of any
//     layout (layout.py's CPU rewrite makes the activations channels-last and leaves the weights NCHW);
//     otherwise, and for anything the call rejects (the first failure sticks), the same computation runs
//     through ATen.
//  3. A 1x1 convolution (stride 1, no padding, one group) of little work, under kMatmulMacs multiply-adds, is
//     ATen's matmul of the source's [N * H * W, C] rows (a view of a channels-last source, or of any source with
//     H = W = 1) by the weights, whichever library runs the rest: a oneDNN call costs about 40 us before any work
//     with packed weights and 80-100 us without. 2-core host, ms per call with relu, the fused call on packed
//     weights / the matmul: squeeze-excitation's 440->110 at 1x1 0.043 / 0.013, at batch 8 0.057 / 0.021;
//     96->96 at 8x8 0.043 / 0.022; 256->64 at 14x14 0.074 / 0.053; 440->440 at 4x4 0.069 / 0.071; 1024->256 at
//     5x5 (6.6M) 0.095 / 0.114. torchvision regnet_y_400mf's 32 such calls took 1.9-3.4 ms of its 63-67 ms
//     training step.
// With EMBER_ONEDNN_CONV=1: ember's oneDNN (Debian's) with any epilogue.
//  1. Source and result keep the layout eager gives them: channels-last when the source or the weights are
//     channels-last (as ATen's oneDNN path decides), else contiguous NCHW; oneDNN reads and writes them in
//     place, one primitive per shape and layout.
//  2. Weights that are a parameter coming back unmodified are packed once into oneDNN's blocked layout
//     (WeightsPacking, as for matmuls).
//  3. Anything oneDNN does not take (other dtypes, an addend laid out unlike the result, a padding oneDNN
//     rejects) runs the same computation through ATen.
#include "ember/error.h"
#include "kernels/cpu/cpu_kernel.h"
#include "kernels/cpu/epilogue_support.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <atomic>
#include <mutex>
#include <optional>

namespace ember::cpu {
namespace {

// torch's call (the file's first part): the operator handles and the arguments that never change.
constexpr int64_t kMatmulMacs = int64_t(1) << 22;  // item 3

struct TorchConv {
  c10::OperatorHandle conv, binary, reorder;
  bool add = false;  // the .binary form: a residual added, then the unary post-op
  size_t fused = 0;  // how many of the epilogue's ops the call applies; ATen applies the rest (a relu)
  c10::IValue padding, stride, dilation, groups, unary, algorithm, scalars, binary_attr;
};

class Conv2dKernel final : public Kernel {
 public:
  Conv2dKernel(const EpilogueGroup& g, std::unique_ptr<onednn::Conv2d> dnnl, std::optional<TorchConv> torch)
      : dnnl_(std::move(dnnl)), torch_(std::move(torch)), dtype_(g.dtype), bias_(g.bias != nullptr), ops_(g.ops),
        addend_is_row_(g.addend_is_row), pack_(g.weights_input != nullptr), text_(g.text()),
        where_("%" + g.members.front()->outputs[0]->name + " = " + g.members.front()->op), groups_(g.groups),
        library_ops_(library_exact_ops(g)) {
    for (int i = 0; i < 2; ++i) stride_[i] = g.stride[i], padding_[i] = g.padding[i], dilation_[i] = g.dilation[i];
    pointwise_ = g.groups == 1 && stride_[0] == 1 && stride_[1] == 1 && padding_[0] == 0 && padding_[1] == 0;
  }

  void run(std::vector<c10::IValue>& buffers, const std::vector<uint32_t>& reads,
           const std::vector<uint32_t>& writes) const override {
    size_t r = 0;
    GroupOperands g = read_operands(buffers, reads, bias_, addend_is_row_.size(), &r);
    const at::Tensor* weights_input = pack_ ? &buffers[reads[r++]].toTensor() : nullptr;
    at::Tensor out;
    const bool done = run_as_matmul(g, &out) || (torch_ ? run_torch(g, weights_input, &out) : run_onednn(g, weights_input, &out));
    if (!done) {
      try {
        at::Tensor y = at::convolution(*g.src, *g.weights, g.bias, stride_, padding_, dilation_, false, {0, 0}, groups_);
        out = apply_epilogue_with_aten(std::move(y), ops_, g.addends, addend_is_row_);
      } catch (const c10::Error& e) {
        rethrow_naming(e, where_);
      }
    }
    buffers[writes[0]] = std::move(out);
  }

  // "onednn ..." either way (ember.explain lists both as oneDNN calls), torch's marked.
  std::string describe() const override { return "onednn " + text_ + (torch_ ? " via torch" : ""); }

 private:
  // Item 3; false where it does not apply.
  bool run_as_matmul(const GroupOperands& g, at::Tensor* out) const {
    const at::Tensor &src = *g.src, &weights = *g.weights;
    if (!pointwise_ || src.dim() != 4 || weights.dim() != 4 || weights.size(2) != 1 || weights.size(3) != 1) return false;
    const int64_t n = src.size(0), c = src.size(1), h = src.size(2), w = src.size(3), k = weights.size(0);
    if (n * h * w * c * k >= kMatmulMacs || src.numel() == 0 || weights.size(1) != c) return false;
    if (!src.is_contiguous(at::MemoryFormat::ChannelsLast) || weights.scalar_type() != src.scalar_type()) return false;
    if (g.bias.defined() && g.bias.scalar_type() != src.scalar_type()) return false;
    try {
      at::Tensor rows = src.permute({0, 2, 3, 1}).view({n * h * w, c});
      at::Tensor by = weights.reshape({k, c}).t();
      at::Tensor y = g.bias.defined() ? at::addmm(g.bias, rows, by) : at::mm(rows, by);
      *out = apply_epilogue_with_aten(y.view({n, h, w, k}).permute({0, 3, 1, 2}), ops_, g.addends, addend_is_row_);
    } catch (const c10::Error& e) {
      rethrow_naming(e, where_);
    }
    return true;
  }

  bool run_onednn(const GroupOperands& g, const at::Tensor* weights_input, at::Tensor* out) const {
    const at::Tensor &src = *g.src, &weights = *g.weights, &bias = g.bias;
    if (src.dim() != 4 || weights.dim() != 4 || src.scalar_type() != dtype_ || weights.scalar_type() != dtype_) return false;
    if (src.numel() == 0 || weights.numel() == 0 || src.size(1) != weights.size(1) * groups_) return false;
    if (bias.defined() && (bias.scalar_type() != dtype_ || !bias.is_contiguous())) return false;
    bool first = weights_input && packing_.first_sight();
    uint64_t packing = weights_input ? packing_.generation(*weights_input, weights) : 0;
    if (first) return false;
    std::vector<int64_t> out_sizes = {src.size(0), weights.size(0), 0, 0};
    for (int i = 0; i < 2; ++i) {
      int64_t extent = dilation_[i] * (weights.size(2 + i) - 1) + 1;
      out_sizes[2 + i] = (src.size(2 + i) + 2 * padding_[i] - extent) / stride_[i] + 1;
      if (out_sizes[2 + i] <= 0) return false;
    }
    bool channels_last = src.suggest_memory_format() == at::MemoryFormat::ChannelsLast ||
                         weights.suggest_memory_format() == at::MemoryFormat::ChannelsLast;
    *out = at::empty(out_sizes, src.options().memory_format(channels_last ? at::MemoryFormat::ChannelsLast
                                                                           : at::MemoryFormat::Contiguous));
    onednn::Conv2dCall call;
    for (int d = 0; d < 4; ++d) {
      call.src_sizes[d] = src.size(d), call.src_strides[d] = src.stride(d);
      call.weights_sizes[d] = weights.size(d), call.weights_strides[d] = weights.stride(d);
      call.dst_sizes[d] = out->size(d), call.dst_strides[d] = out->stride(d);
    }
    for (const at::Tensor& a : g.addends) {
      if (a.scalar_type() != dtype_ || !a.sizes().equals(out->sizes()) || !a.strides().equals(out->strides())) return false;
      call.addends.push_back(a.data_ptr());
    }
    call.src = src.data_ptr();
    call.weights = weights.data_ptr();
    call.bias = bias.defined() ? bias.data_ptr() : nullptr;
    call.dst = out->data_ptr();
    try {
      dnnl_->run(call, packing);
    } catch (const std::exception&) {
      return false;
    }
    if (library_ops_ < ops_.size()) *out = apply_epilogue_with_aten(std::move(*out), ops_, g.addends, addend_is_row_, library_ops_);
    return true;
  }

  bool run_torch(const GroupOperands& g, const at::Tensor* weights_input, at::Tensor* out) const {
    const at::Tensor &src = *g.src, &weights = *g.weights, &bias = g.bias;
    if (failed_.load(std::memory_order_relaxed)) return false;
    if (src.dim() != 4 || weights.dim() != 4 || src.numel() == 0 || weights.numel() == 0) return false;
    const at::MemoryFormat format = src.suggest_memory_format();
    if (!src.is_contiguous(format)) return false;
    // Packed weights only for channels-last sources: with an NCHW source the call then answers in
    // channels-last (and ran slower than unpacked on the 2-core host). Packed, their own layout no longer
    // matters, and eager's result is channels-last as the source is (layout.py's CPU rewrite).
    uint64_t generation = 0;
    if (weights_input && format == at::MemoryFormat::ChannelsLast) generation = packing_.generation(*weights_input, weights);
    if (generation == 0 && weights.suggest_memory_format() != format) return false;  // item 2
    if (bias.defined() && !bias.is_contiguous()) return false;
    const TorchConv& t = *torch_;
    if (t.add && (g.addends.size() != 1 || !g.addends[0].is_contiguous(format))) return false;
    try {
      at::Tensor w = generation != 0 ? packed(weights, src, generation) : weights;
      torch::jit::Stack stack;
      stack.reserve(13);
      stack.emplace_back(src);
      if (t.add) stack.emplace_back(g.addends[0]);
      stack.emplace_back(std::move(w));
      stack.emplace_back(bias.defined() ? c10::IValue(bias) : c10::IValue());
      stack.emplace_back(t.padding), stack.emplace_back(t.stride), stack.emplace_back(t.dilation), stack.emplace_back(t.groups);
      if (t.add) stack.emplace_back(t.binary_attr), stack.emplace_back(c10::IValue());  // binary_attr, alpha
      stack.emplace_back(t.unary), stack.emplace_back(t.scalars), stack.emplace_back(t.algorithm);
      (t.add ? t.binary : t.conv).callBoxed(&stack);
      *out = std::move(stack[0]).toTensor();
      if (!out->is_contiguous(format)) *out = out->contiguous(format);  // eager's layout, whatever torch's answer
      if (t.fused < ops_.size()) *out = apply_epilogue_with_aten(std::move(*out), ops_, g.addends, addend_is_row_, t.fused);
      return true;
    } catch (const std::exception&) {  // e.g. bf16 on a CPU without it: ATen from now on
      exception_handled();
      failed_.store(true, std::memory_order_relaxed);
      return false;
    }
  }

  // `weights` reordered for `src`'s sizes, made once per packing generation and source shape.
  at::Tensor packed(const at::Tensor& weights, const at::Tensor& src, uint64_t generation) const {
    std::lock_guard<std::mutex> lock(packed_mu_);
    if (generation == packed_generation_ && src.sizes().equals(packed_for_)) return packed_;
    const TorchConv& t = *torch_;
    torch::jit::Stack stack{c10::IValue(weights), t.padding, t.stride, t.dilation, t.groups, c10::IValue(src.sizes().vec())};
    t.reorder.callBoxed(&stack);
    packed_ = std::move(stack[0]).toTensor();
    packed_generation_ = generation;
    packed_for_ = src.sizes().vec();
    return packed_;
  }

  std::unique_ptr<onednn::Conv2d> dnnl_;
  std::optional<TorchConv> torch_;
  c10::ScalarType dtype_;
  bool bias_;
  std::vector<EpilogueOp> ops_;
  std::vector<bool> addend_is_row_;
  bool pack_;
  std::string text_, where_;
  int64_t stride_[2], padding_[2], dilation_[2], groups_;
  bool pointwise_ = false;  // a 1x1 kernel would make it a matmul (item 3)
  size_t library_ops_;  // ember's oneDNN applies ops_[0, library_ops_) as post-ops, ATen the rest
  WeightsPacking packing_;
  mutable std::atomic<bool> failed_{false};
  mutable std::mutex packed_mu_;
  mutable at::Tensor packed_;
  mutable uint64_t packed_generation_ = 0;
  mutable std::vector<int64_t> packed_for_;
};

// torch's call for group `g`, or nothing (with the reason) where this torch has no such op or the call
// does not apply g's epilogue.
std::optional<TorchConv> torch_conv(const EpilogueGroup& g, std::string* why_not) {
  if (!torch_conv_takes(g.ops)) {
    if (why_not) *why_not = "an epilogue torch's oneDNN convolution does not apply: " + g.text();
    return std::nullopt;
  }
  auto find = [](const char* name, const char* overload) { return c10::Dispatcher::singleton().findSchema({name, overload}); };
  auto conv = find("mkldnn::_convolution_pointwise", ""), binary = find("mkldnn::_convolution_pointwise", "binary");
  auto reorder = find("mkldnn::_reorder_convolution_weight", "");
  if (!conv || !binary || !reorder) {
    if (why_not) *why_not = "this torch has no mkldnn::_convolution_pointwise";
    return std::nullopt;
  }
  TorchConv t{*conv, *binary, *reorder};
  t.add = !g.ops.empty() && g.ops[0].kind == EpilogueOp::Kind::Add;
  const char* algorithm = nullptr;
  // A sigmoid is ATen's too: torch's sigmoid post-op maps NaN to 0 where the convolution pads (torch 2.13's
  // CPU oneDNN; fuzz seed 623693), as a relu does everywhere.
  const bool aten_sigmoid = !g.ops.empty() && g.ops.back().kind == EpilogueOp::Kind::Sigmoid;
  const char* activation = g.ops.empty() || aten_sigmoid ? nullptr : torch_activation(g.ops.back().kind, &algorithm);
  std::string unary = activation ? activation : "none";  // none: no op, the add alone, or what ATen applies
  t.fused = (t.add ? 1 : 0) + (activation ? 1 : 0);
  t.padding = c10::IValue(std::vector<int64_t>(g.padding, g.padding + 2));
  t.stride = c10::IValue(std::vector<int64_t>(g.stride, g.stride + 2));
  t.dilation = c10::IValue(std::vector<int64_t>(g.dilation, g.dilation + 2));
  t.groups = c10::IValue(g.groups);
  // The .binary form takes no unary op as None ("none" is an error there: "Unary Fusion behavior undefined").
  t.unary = t.add && !activation ? c10::IValue() : c10::IValue(unary);
  t.algorithm = algorithm ? c10::IValue(std::string(algorithm)) : c10::IValue();
  t.scalars = c10::IValue(c10::List<std::optional<at::Scalar>>());
  t.binary_attr = c10::IValue(std::string("add"));
  return t;
}

}  // namespace

std::shared_ptr<const Kernel> make_conv2d_kernel(const EpilogueGroup& g, std::string* why_not) {
  if (g.dtype != c10::kFloat && g.dtype != c10::kBFloat16) {
    if (why_not) *why_not = std::string("oneDNN convolution for ") + dtype_name(g.dtype);
    return nullptr;
  }
  if (!onednn_convolutions_requested()) {
    std::optional<TorchConv> torch = torch_conv(g, why_not);
    if (!torch) return nullptr;
    return std::make_shared<Conv2dKernel>(g, nullptr, std::move(torch));
  }
  onednn::Conv2dConfig config;
  config.dtype = onednn_dtype(g.dtype);
  config.bias = g.bias != nullptr;
  config.post_ops = post_ops_of(g, library_exact_ops(g));
  for (int i = 0; i < 2; ++i)
    config.stride[i] = g.stride[i], config.padding[i] = g.padding[i], config.dilation[i] = g.dilation[i];
  config.groups = g.groups;
  auto dnnl = onednn::Conv2d::create(config, why_not);
  if (!dnnl) return nullptr;
  return std::make_shared<Conv2dKernel>(g, std::move(dnnl), std::nullopt);
}

}  // namespace ember::cpu
