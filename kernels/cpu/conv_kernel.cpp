// The CPU kernel for a claimed 2-D convolution group: one oneDNN convolution with the epilogue as post-ops.
//  1. Source and result keep the layout eager gives them: channels-last when the source or the weights are
//     channels-last (as ATen's oneDNN path decides), else contiguous NCHW; oneDNN reads and writes them in
//     place, one primitive per shape and layout.
//  2. Weights that are a parameter coming back unmodified are packed once into oneDNN's blocked layout
//     (WeightsPacking, as for matmuls).
//  3. Anything oneDNN does not take (other dtypes, an addend laid out unlike the result, a padding oneDNN
//     rejects) runs the same computation through ATen.
#include "kernels/cpu/cpu_kernel.h"
#include "kernels/cpu/epilogue_support.h"

namespace ember::cpu {
namespace {

class Conv2dKernel final : public Kernel {
 public:
  Conv2dKernel(const EpilogueGroup& g, std::unique_ptr<onednn::Conv2d> dnnl)
      : dnnl_(std::move(dnnl)), dtype_(g.dtype), bias_(g.bias != nullptr), ops_(g.ops),
        addend_is_row_(g.addend_is_row), pack_(g.weights_input != nullptr), text_(g.text()),
        where_("%" + g.members.front()->outputs[0]->name + " = " + g.members.front()->op), groups_(g.groups) {
    for (int i = 0; i < 2; ++i) stride_[i] = g.stride[i], padding_[i] = g.padding[i], dilation_[i] = g.dilation[i];
  }

  void run(std::vector<c10::IValue>& buffers, const std::vector<uint32_t>& reads,
           const std::vector<uint32_t>& writes) const override {
    size_t r = 0;
    const at::Tensor& src = buffers[reads[r++]].toTensor();
    const at::Tensor& weights = buffers[reads[r++]].toTensor();
    at::Tensor bias = bias_ ? buffers[reads[r++]].toTensor() : at::Tensor();
    std::vector<at::Tensor> addends;
    for (size_t i = 0; i < addend_is_row_.size(); ++i) addends.push_back(buffers[reads[r++]].toTensor());
    const at::Tensor* weights_input = pack_ ? &buffers[reads[r++]].toTensor() : nullptr;
    at::Tensor out;
    if (!run_onednn(src, weights, weights_input, bias, addends, &out)) {
      try {
        at::Tensor y = at::convolution(src, weights, bias, stride_, padding_, dilation_, false, {0, 0}, groups_);
        out = apply_epilogue_with_aten(std::move(y), ops_, addends, addend_is_row_);
      } catch (const c10::Error& e) {
        throw std::runtime_error(std::string(e.what_without_backtrace()) + "\n(ember: while running " + where_ + ")");
      }
    }
    buffers[writes[0]] = std::move(out);
  }

  std::string describe() const override { return "onednn " + text_; }

 private:
  bool run_onednn(const at::Tensor& src, const at::Tensor& weights, const at::Tensor* weights_input,
                  const at::Tensor& bias, const std::vector<at::Tensor>& addends, at::Tensor* out) const {
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
    for (const at::Tensor& a : addends) {
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
    return true;
  }

  std::unique_ptr<onednn::Conv2d> dnnl_;
  c10::ScalarType dtype_;
  bool bias_;
  std::vector<EpilogueOp> ops_;
  std::vector<bool> addend_is_row_;
  bool pack_;
  std::string text_, where_;
  int64_t stride_[2], padding_[2], dilation_[2], groups_;
  WeightsPacking packing_;
};

}  // namespace

std::shared_ptr<const Kernel> make_conv2d_kernel(const EpilogueGroup& g, std::string* why_not) {
  if (g.dtype != c10::kFloat && g.dtype != c10::kBFloat16) {
    if (why_not) *why_not = std::string("oneDNN convolution for ") + dtype_name(g.dtype);
    return nullptr;
  }
  onednn::Conv2dConfig config;
  config.dtype = onednn_dtype(g.dtype);
  config.bias = g.bias != nullptr;
  config.post_ops = post_ops_of(g);
  for (int i = 0; i < 2; ++i)
    config.stride[i] = g.stride[i], config.padding[i] = g.padding[i], config.dilation[i] = g.dilation[i];
  config.groups = g.groups;
  auto dnnl = onednn::Conv2d::create(config, why_not);
  if (!dnnl) return nullptr;
  return std::make_shared<Conv2dKernel>(g, std::move(dnnl));
}

}  // namespace ember::cpu
