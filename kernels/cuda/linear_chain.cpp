// ember::linear_chain on CUDA as one launch of ember_chain_* (kernels/cuda/gemm_kernels.cu): a FastPath for
// the op that passes/linear_chain.cpp makes of consecutive small linear layers.
//  1. Why: each layer of such a chain costs a launch and an output allocation as its own GEMM step (6.6 us of
//     host time per layer on the H100 host, 20 x Linear(100, 100) at batch 32, default mode), and a graph
//     node when captured, for a few microseconds of GPU work. Here the chain is one kernel: its blocks take
//     R rows each through every layer (R = 4 up to 128 rows, so that small batches still spread over
//     several multiprocessors; 16 beyond), the activations in shared memory, the next layer's weights
//     copied in (cp.async) while the current one multiplies; a softmax or log_softmax over the result's rows
//     as its epilogue.
//  2. Made once per step: the layers' sizes, strides, activations and each layer's copy mode, the kernel's
//     shared memory (two weight buffers of the widest layer, or one where two do not fit in what the
//     device allows a block; the kernel then copies after each layer's products) and the entry point. Per
//     call: operand checks, the output allocation, the parameter block's pointers and one launch.
//  3. Declines (the op's ATen implementation runs, kernels/linear_chain_op.cpp) for operands of other
//     sizes, strides, dtype or device than the IR's, and on a device without the kernel image or with too
//     little shared memory for one layer. Its sums run in a fixed order, so it also runs where
//     deterministic algorithms are asked for.
//  4. cp.async needs sm_80 and aligned rows: a layer's weights (K-contiguous, as a linear layer's transposed
//     weight is, or N-contiguous, as a plain right operand is) are copied as they lie, in 16-byte pieces where
//     their rows start and end on 16-byte boundaries, in 4-byte pieces where on 4-byte ones; otherwise (and
//     before sm_80) the threads load and store them.
#include "ember/runtime.h"
#include "kernels/cuda/driver.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace ember::cuda {

const void* gemm_kernels_image();  // kernels/cuda/gemm_image.cpp

namespace {

constexpr int kMaxLayers = 32;  // EMBER_CHAIN_MAX_LAYERS
constexpr int kThreads = 256;
constexpr int kMaxWidth = 128;

// Mirrors ChainLayer / ChainParams in gemm_kernels.cu.
struct ChainLayer {
  const void* w;
  const void* bias;
  int64_t s0, s1;
  int k, n;
  int act;
  int copy;
  int b_rows;
  int ws;
};
struct ChainParams {
  const void* x;
  void* out;
  int64_t m, sx0, sx1;
  int layers;
  int wsize;
  int astride;
  int buffers;
  int softmax;
  ChainLayer layer[kMaxLayers];
};

class LinearChain final : public FastPath {
 public:
  struct Layer {
    uint32_t weights;  // buffer of B [k, n]
    int32_t bias;      // buffer, or -1
    int64_t k, n, s0, s1;
    int act;
  };

  LinearChain(uint32_t x, std::vector<Layer> layers, int softmax, int32_t out, int64_t m, c10::ScalarType dtype,
              int device)
      : x_(x), layers_(std::move(layers)), softmax_(softmax), out_(out), m_(m), dtype_(dtype), device_(device) {}

  bool run(std::vector<c10::IValue>& buffers) const override {
    std::call_once(prepared_, [this] { prepare(); });
    if (!function_) return false;
    const at::Tensor* x = buffer_tensor(buffers, x_);
    if (!x || !fits(*x, m_, layers_.front().k) || reinterpret_cast<uintptr_t>(x->data_ptr()) % elem_ != 0) return false;
    ChainParams p = params_;
    p.x = x->data_ptr();
    p.sx0 = x->stride(0), p.sx1 = x->stride(1);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      const at::Tensor* w = buffer_tensor(buffers, l.weights);
      if (!w || !fits(*w, l.k, l.n) || w->stride(0) != l.s0 || w->stride(1) != l.s1) return false;
      ChainLayer& cl = p.layer[i];
      cl.w = w->data_ptr();
      const uintptr_t address = reinterpret_cast<uintptr_t>(cl.w);
      if (address % elem_ != 0) return false;
      if (cl.copy == 2 && address % 16 != 0) cl.copy = address % 4 == 0 ? 1 : 0;
      if (cl.copy == 1 && address % 4 != 0) cl.copy = 0;
      if (l.bias >= 0) {
        const at::Tensor* b = buffer_tensor(buffers, static_cast<uint32_t>(l.bias));
        if (!b || b->dim() != 1 || b->size(0) != l.n || (l.n > 1 && b->stride(0) != 1) || b->scalar_type() != dtype_ ||
            !b->is_cuda() || b->get_device() != device_ || reinterpret_cast<uintptr_t>(b->data_ptr()) % elem_ != 0)
          return false;
        cl.bias = b->data_ptr();
      }
    }
    at::Tensor out = at::empty({m_, layers_.back().n}, x->options());
    p.out = out.data_ptr();
    launch(function_, blocks_, kThreads, at::cuda::getCurrentCUDAStream(device_).stream(), &p, device_, 1, shared_bytes_);
    buffers[out_] = std::move(out);
    calls_.fetch_add(1, std::memory_order_relaxed);
    return true;
  }

  std::string describe() const override {
    std::string widths = std::to_string(layers_.front().k);
    for (const Layer& l : layers_) widths += "-" + std::to_string(l.n);
    return "ember linear chain kernel, " + std::to_string(layers_.size()) + " layers " + widths + " x " +
           std::to_string(m_) + " rows" + (softmax_ == 1 ? ", softmax" : softmax_ == 2 ? ", log_softmax" : "") + (function_ ? ", " + std::to_string(params_.buffers) + " weight buffers" : "") +
           ", " + std::to_string(calls_.load(std::memory_order_relaxed)) + " calls";
  }

 private:
  bool fits(const at::Tensor& t, int64_t rows, int64_t cols) const {
    return t.dim() == 2 && t.layout() == at::kStrided && t.is_cuda() && t.get_device() == device_ &&
           t.scalar_type() == dtype_ && t.size(0) == rows && t.size(1) == cols;
  }

  // The entry point, launch shape and shared memory; function_ stays null where the device cannot run it.
  void prepare() const {
    elem_ = static_cast<int>(c10::elementSize(dtype_));
    const int rows = m_ <= 128 ? 4 : 16;  // up to 32 blocks of 4 rows: small batches spread over more SMs
    const std::string name = std::string("ember_chain_r") + (rows == 4 ? "4_" : "16_") +
                             (dtype_ == c10::kFloat ? "f32" : dtype_ == c10::kHalf ? "f16" : "bf16");
    void* function = nullptr;
    int major = 0;
    try {
      function = load_image(gemm_kernels_image(), {name}, device_).front();
      major = std::stoi(arch(device_).substr(3)) / 10;
    } catch (const std::exception&) {
      return;  // no image for this device: the op's ATen implementation runs
    }
    ChainParams p{};
    p.m = m_;
    p.layers = static_cast<int>(layers_.size());
    p.softmax = softmax_;
    int64_t widest = 0, deepest = 0, largest = 0;
    const int per16 = 16 / elem_;  // elements per 16 bytes
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      ChainLayer& cl = p.layer[i];
      widest = std::max(widest, l.n), deepest = std::max(deepest, l.k);
      cl.s0 = l.s0, cl.s1 = l.s1;
      cl.k = static_cast<int>(l.k), cl.n = static_cast<int>(l.n);
      cl.act = l.act;
      const int64_t k4 = (l.k + 3) / 4 * 4;
      const bool k_contiguous = l.s0 == 1 || l.k == 1;
      cl.b_rows = !k_contiguous && (l.s1 == 1 || l.n == 1);
      int64_t ws = 0;
      if (cl.b_rows) {
        ws = (l.n + per16 - 1) / per16 * per16;
      } else {  // rows of B^T read 16 (8) bytes per lane: spaced 16 bytes past a multiple of 128
        ws = (k4 + per16 - 1) / per16 * per16;
        while (ws * elem_ % 128 != 16) ws += per16;
      }
      cl.ws = static_cast<int>(ws);
      largest = std::max(largest, (cl.b_rows ? k4 : l.n) * ws);
      const bool rows_contiguous = cl.b_rows || k_contiguous;
      const int64_t memory_rows = cl.b_rows ? l.k : l.n;
      const int64_t row_bytes = (cl.b_rows ? l.n : l.k) * elem_, step_bytes = (cl.b_rows ? l.s0 : l.s1) * elem_;
      cl.copy = major < 8 || !rows_contiguous ? 0
                : row_bytes % 16 == 0 && (step_bytes % 16 == 0 || memory_rows == 1) ? 2
                : row_bytes % 4 == 0 && (step_bytes % 4 == 0 || memory_rows == 1)   ? 1
                                                                                    : 0;
    }
    p.wsize = static_cast<int>(largest);
    p.astride = static_cast<int>((std::max(widest, deepest) + 3) / 4 * 4 + 4);
    const int64_t weights = static_cast<int64_t>(p.wsize) * elem_;
    const int64_t activations = 2 * static_cast<int64_t>(rows) * p.astride * 4;
    int64_t limit = 0;
    try {
      limit = max_shared_memory_optin(device_);
    } catch (const std::exception&) {
      return;
    }
    p.buffers = 2 * weights + activations <= limit ? 2 : weights + activations <= limit ? 1 : 0;
    if (p.buffers == 0) return;
    shared_bytes_ = static_cast<unsigned>(p.buffers * weights + activations);
    try {
      set_max_dynamic_shared_memory(function, static_cast<int>(shared_bytes_));
    } catch (const std::exception&) {
      return;
    }
    blocks_ = static_cast<unsigned>((m_ + rows - 1) / rows);
    params_ = p;
    function_ = function;
  }

  uint32_t x_;
  std::vector<Layer> layers_;
  int softmax_;  // 0 none, 1 softmax, 2 log_softmax over each row of the result
  int32_t out_;
  int64_t m_;
  c10::ScalarType dtype_;
  int device_;
  mutable std::once_flag prepared_;
  mutable void* function_ = nullptr;
  mutable ChainParams params_{};
  mutable unsigned blocks_ = 0, shared_bytes_ = 0;
  mutable int elem_ = 4;
  mutable std::atomic<uint64_t> calls_{0};  // for describe(): tests check the kernel ran
};

const ListSlot* list_at(const Step& step, uint32_t slot) {
  for (const ListSlot& l : step.lists)
    if (l.slot == slot) return &l;
  return nullptr;
}

std::shared_ptr<const FastPath> make_linear_chain(const Node& n, const Step& step, const Tuning&) {
  if (n.op != "ember::linear_chain" || n.args.size() < 4 || n.args.size() > 5 || !n.kwargs.empty() ||
      n.outputs.size() != 1 || step.outputs.size() != 1 || step.outputs[0] < 0 || !n.outputs[0]->type.is_tensor())
    return nullptr;
  int softmax = 0;
  if (n.args.size() == 5) {
    if (n.args[4].kind != Arg::Kind::Int || n.args[4].i < 0 || n.args[4].i > 2) return nullptr;
    softmax = static_cast<int>(n.args[4].i);
  }
  const Arg& xa = n.args[0];
  const Arg& wa = n.args[1];
  const Arg& ba = n.args[2];
  const Arg& aa = n.args[3];
  if (!xa.is_value() || wa.kind != Arg::Kind::List || ba.kind != Arg::Kind::List || aa.kind != Arg::Kind::List)
    return nullptr;
  const size_t count = wa.list.size();
  if (count < 1 || count > static_cast<size_t>(kMaxLayers) || ba.list.size() != count || aa.list.size() != count)
    return nullptr;
  const std::optional<uint32_t> x = slot_buffer(step, 0);
  const ListSlot* weights = list_at(step, 1);
  const ListSlot* biases = list_at(step, 2);  // null: every bias is None
  if (!x || !weights || weights->item_buffer.size() != count || (biases && biases->item_buffer.size() != count))
    return nullptr;
  const TensorType& xt = xa.value->type.tensor;
  const TensorType& out = n.outputs[0]->type.tensor;
  if (xt.sizes.size() != 2 || !xt.sizes[0].is_constant() || !xt.sizes[1].is_constant() || !out.device.is_cuda())
    return nullptr;
  const c10::ScalarType dtype = out.dtype;
  if (dtype != c10::kFloat && dtype != c10::kHalf && dtype != c10::kBFloat16) return nullptr;
  std::vector<LinearChain::Layer> layers;
  int64_t k = xt.sizes[1].value;
  for (size_t i = 0; i < count; ++i) {
    const Arg& w = wa.list[i];
    if (!w.is_value() || weights->item_buffer[i] < 0 || aa.list[i].kind != Arg::Kind::Int) return nullptr;
    const TensorType& wt = w.value->type.tensor;
    if (wt.sizes.size() != 2 || wt.strides.size() != 2 || !wt.sizes[0].is_constant() || !wt.sizes[1].is_constant() ||
        !wt.strides[0].is_constant() || !wt.strides[1].is_constant() || wt.sizes[0].value != k || wt.dtype != dtype)
      return nullptr;
    LinearChain::Layer l;
    l.weights = static_cast<uint32_t>(weights->item_buffer[i]);
    l.k = k, l.n = wt.sizes[1].value;
    l.s0 = wt.strides[0].value, l.s1 = wt.strides[1].value;
    l.act = static_cast<int>(aa.list[i].i);
    l.bias = -1;
    if (ba.list[i].is_value()) {
      if (!biases || biases->item_buffer[i] < 0) return nullptr;
      l.bias = biases->item_buffer[i];
    } else if (ba.list[i].kind != Arg::Kind::None || l.act != 0) {
      return nullptr;
    }
    if (l.k < 1 || l.k > kMaxWidth || l.n < 1 || l.n > kMaxWidth || l.act < 0 || l.act > 2) return nullptr;
    layers.push_back(l);
    k = l.n;
  }
  return std::make_shared<LinearChain>(*x, std::move(layers), softmax, step.outputs[0],
                                       xt.sizes[0].value, dtype, out.device.has_index() ? out.device.index() : 0);
}

const bool registered = (register_fast_path(&make_linear_chain), true);

}  // namespace
}  // namespace ember::cuda
