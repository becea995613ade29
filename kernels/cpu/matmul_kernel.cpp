// The CPU kernel for a claimed matmul group: one oneDNN matmul with the epilogue as post-ops.
//  1. Per call it reads the operands' sizes and strides and hands oneDNN pointers (kernels/cpu/onednn.h); the
//     primitive for that shape was made on first sight.
//  2. Weights that are a graph input (a parameter, or a transposing view of one) and come back unmodified
//     are packed once into oneDNN's layout on their second sight and reused (WeightsPacking).
//  3. Fewer than 8 float32 rows against weights as they lie, with contiguous columns (nn.Linear's), run
//     ember's own loop (kernels/cpu/gemv.cpp): reading the weights is the work, and it spreads that over
//     the threads, where oneDNN's plain-layout kernels and MKL do not.
//  4. Operands neither takes as they are (neither rows nor columns contiguous, an empty dimension, an
//     addend that is not contiguous) run the same computation through ATen, so every input is correct; so
//     do a few bfloat16 rows, or rows against row-major weights, unless the weights are packed.
#include "kernels/cpu/cpu_kernel.h"
#include "kernels/cpu/epilogue_support.h"
#include "kernels/cpu/gemv.h"

namespace ember::cpu {
namespace {

// A matrix's (stride0, stride1) as oneDNN's fast kernels take it: rows or columns contiguous. A dimension
// of size 1 takes the stride that makes the layout plain, whatever the tensor says.
bool plain_strides(const at::Tensor& t, int64_t out[2]) {
  int64_t rows = t.size(0), cols = t.size(1);
  int64_t s0 = rows == 1 ? cols : t.stride(0), s1 = cols == 1 ? rows : t.stride(1);
  if (rows == 1 && cols == 1) s0 = s1 = 1;
  if (s1 == 1 && s0 >= cols) { out[0] = s0, out[1] = 1; return true; }
  if (s0 == 1 && s1 >= rows) { out[0] = 1, out[1] = s1; return true; }
  return false;
}

class MatmulKernel final : public Kernel {
 public:
  MatmulKernel(const EpilogueGroup& m, std::unique_ptr<onednn::Matmul> dnnl, onednn::MatmulConfig config)
      : dnnl_(std::move(dnnl)), config_(std::move(config)), dtype_(m.dtype), bias_(m.bias != nullptr), ops_(m.ops),
        addend_is_row_(m.addend_is_row), pack_(m.weights_input != nullptr), text_(m.text()),
        where_("%" + m.members.front()->outputs[0]->name + " = " + m.members.front()->op) {
    for (const auto& [constant, value] : m.out_shape) out_shape_.emplace_back(constant, value != nullptr);
  }

  void run(std::vector<c10::IValue>& buffers, const std::vector<uint32_t>& reads,
           const std::vector<uint32_t>& writes) const override {
    size_t r = 0;
    GroupOperands g = read_operands(buffers, reads, bias_, addend_is_row_.size(), &r);
    const at::Tensor &src = *g.src, &weights = *g.weights, &bias = g.bias;
    const std::vector<at::Tensor>& addends = g.addends;
    std::vector<int64_t> shape;
    for (const auto& [constant, from_buffer] : out_shape_) shape.push_back(from_buffer ? buffers[reads[r++]].toInt() : constant);
    const at::Tensor* weights_input = pack_ ? &buffers[reads[r++]].toTensor() : nullptr;

    at::Tensor out;
    if (!run_onednn(src, weights, weights_input, bias, addends, &out)) {
      try {
        out = run_aten(src, weights, bias, addends);
      } catch (const c10::Error& e) {
        rethrow_naming(e, where_);
      }
    }
    buffers[writes[0]] = shape.empty() ? std::move(out) : out.view(shape);
  }

  std::string describe() const override { return "onednn " + text_; }

 private:
  bool run_onednn(const at::Tensor& src, const at::Tensor& weights, const at::Tensor* weights_input, const at::Tensor& bias,
                  const std::vector<at::Tensor>& addends, at::Tensor* out) const {
    if (src.dim() != 2 || weights.dim() != 2 || src.size(1) != weights.size(0)) return false;
    if (src.scalar_type() != dtype_ || weights.scalar_type() != dtype_) return false;
    onednn::MatmulCall call;
    call.M = src.size(0), call.N = weights.size(1), call.K = src.size(1);
    if (call.M == 0 || call.N == 0 || call.K == 0) return false;
    if (!plain_strides(src, call.src_stride) || !plain_strides(weights, call.weights_stride)) return false;
    if (bias.defined()) {
      if (bias.dim() != 1 || bias.size(0) != call.N || bias.stride(0) != 1 || bias.scalar_type() != dtype_) return false;
      call.bias = bias.data_ptr();
    }
    for (size_t i = 0; i < addends.size(); ++i) {
      const at::Tensor& a = addends[i];
      if (a.scalar_type() != dtype_ || !a.is_contiguous()) return false;
      if (a.numel() != (addend_is_row_[i] ? call.N : call.M * call.N)) return false;
      call.addends.push_back(a.data_ptr());
      if (!addend_is_row_[i]) call.addend_row_stride.push_back(call.N);
    }
    bool first = weights_input && packing_.first_sight();
    uint64_t packing = weights_input ? packing_.generation(*weights_input, weights) : 0;
    call.src = src.data_ptr();
    call.weights = weights.data_ptr();
    // A few rows against weights as they lie (not packed: not a parameter, changed, or seen once) run
    // ember's loop where it applies, else ATen: oneDNN reads plain weights slowly there. 2-core Zen 4 host,
    // [M, 1024] @ [1024, 1024] + bias, relu, min of 7 x 300 calls (this host's timings vary up to 2x):
    //   M = 1 / 2 / 4 / 7, us   oneDNN plain 105 / 110 / 118 / 138, ATen (MKL) 77 / 147 / 305 / 302,
    //                           ember's loop 33 / 38 / 56 / 105, oneDNN packed 33 / 37 / 44 / 72.
    // Packed weights go to oneDNN at any M, as their first sight goes to the loop: no primitive until the
    // second call, when the weights can be packed.
    if (call.M < kFewRows && packing == 0) {
      if (dtype_ != c10::kFloat || !gemv_takes(call)) return false;
      *out = at::empty({call.M, call.N}, src.options());
      call.dst = out->data_ptr();
      call.dst_stride = call.N;
      gemv(config_, call);
      return true;
    }
    if (first) return false;
    *out = at::empty({call.M, call.N}, src.options());
    call.dst = out->data_ptr();
    call.dst_stride = call.N;
    try {
      dnnl_->run(call, packing);
    } catch (const std::exception&) {
      return false;  // the ATen path computes the same thing
    }
    return true;
  }

  at::Tensor run_aten(const at::Tensor& src, const at::Tensor& weights, const at::Tensor& bias,
                      const std::vector<at::Tensor>& addends) const {
    at::Tensor y = bias.defined() ? at::addmm(bias, src, weights) : at::mm(src, weights);
    return apply_epilogue_with_aten(std::move(y), ops_, addends, addend_is_row_);
  }

  static constexpr int64_t kFewRows = 8;
  std::unique_ptr<onednn::Matmul> dnnl_;
  onednn::MatmulConfig config_;  // the post-ops, for gemv()
  c10::ScalarType dtype_;
  bool bias_;
  std::vector<EpilogueOp> ops_;
  std::vector<bool> addend_is_row_;
  std::vector<std::pair<int64_t, bool>> out_shape_;  // (constant, read from a buffer instead)
  bool pack_;
  std::string text_;
  std::string where_;  // "%addmm = aten::addmm", for error messages

  WeightsPacking packing_;
};

}  // namespace

std::shared_ptr<const Kernel> make_matmul_kernel(const EpilogueGroup& m, std::string* why_not) {
  if (!m.device.is_cpu()) {
    if (why_not) *why_not = "not a CPU matmul";
    return nullptr;
  }
  if (m.dtype != c10::kFloat && m.dtype != c10::kBFloat16) {
    if (why_not) *why_not = std::string("oneDNN matmul for ") + dtype_name(m.dtype);
    return nullptr;
  }
  onednn::MatmulConfig config;
  config.dtype = onednn_dtype(m.dtype);
  config.bias = m.bias != nullptr;
  config.post_ops = post_ops_of(m);
  auto dnnl = onednn::Matmul::create(config, why_not);
  if (!dnnl) return nullptr;
  return std::make_shared<MatmulKernel>(m, std::move(dnnl), std::move(config));
}

}  // namespace ember::cpu
