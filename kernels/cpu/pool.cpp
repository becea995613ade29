// aten::max_pool2d_with_indices on the CPU for contiguous (NCHW) float32 inputs: a fast path of the plan
// (runtime.h) that writes the pooled values alone where nothing reads the indices, and both otherwise.
//  1. Why: ATen's CPU kernel for NCHW is a scalar loop that also writes an int64 index per output. On the
//     2-core CI host, resnet18's pooling of 2x64x112x112 took 6.3 ms of the model's 54 (channels_last
//     inputs take ATen's vectorized kernel: 0.32 ms, and stay with it).
//  2. How: per plane and output row, the rows of its window are folded into one row, then that row's runs
//     of kw columns into their maxima, of which every sw-th is an output: loops over contiguous floats,
//     which the compiler vectorizes. Planes run in parallel.
//     With indices, each output scans its window in ATen's order (pool_plane_with_indices), several
//     outputs at once: 2.9 ms against ATen's 6.7-7.4 for the same pooling in resnet18's training step.
//  3. The max follows ATen's rule: a NaN wins and stays. Anything else (dilation, ceil_mode, another dtype
//     or layout) returns false and ATen's op runs.
#include "ember/runtime.h"
#include "kernels/pool_args.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <vector>

namespace ember {
namespace {

// An int or int[] argument as `want` values; empty where absent, {-1} where not ints.
std::vector<int64_t> pool_ints(const Arg* a, size_t want) {
  std::vector<int64_t> out;
  if (!a || a->kind == Arg::Kind::None) return out;
  if (a->kind == Arg::Kind::Int) return std::vector<int64_t>(want, a->i);
  if (a->kind != Arg::Kind::List) return {-1};
  for (const Arg& e : a->list) {
    if (e.kind != Arg::Kind::Int) return {-1};
    out.push_back(e.i);
  }
  if (out.size() == 1) out.assign(want, out[0]);
  return out;
}

}  // namespace

std::optional<MaxPoolArgs> max_pool_args(const Node& n, const Step& step, bool cuda) {
  if (n.op != "aten::max_pool2d_with_indices" || step.outputs.size() != 2 || step.outputs[0] < 0) return std::nullopt;
  // Indices freed by this very step are unread (runtime.h, FastPathMaker).
  int32_t indices = step.outputs[1];
  if (indices >= 0 && std::find(step.frees.begin(), step.frees.end(), static_cast<uint32_t>(indices)) != step.frees.end())
    indices = -1;
  if (!step.lists.empty() || !step.scalar_from_buffer.empty() || n.args.empty() || !n.args[0].is_value()) return std::nullopt;
  const Value* in = n.args[0].value;
  if (!in->type.is_tensor() || in->type.tensor.device.is_cuda() != cuda || in->type.tensor.sizes.size() != 4)
    return std::nullopt;
  std::optional<uint32_t> input;
  for (auto [slot, buf] : step.from_buffer)
    if (slot == 0) input = buf;
  if (!input) return std::nullopt;
  std::vector<int64_t> k = pool_ints(n.arg(1, "kernel_size"), 2), s = pool_ints(n.arg(2, "stride"), 2),
                       p = pool_ints(n.arg(3, "padding"), 2), d = pool_ints(n.arg(4, "dilation"), 2);
  if (s.empty()) s = k;
  if (p.empty()) p = {0, 0};
  const Arg* ceil = n.arg(5, "ceil_mode");
  if (k.size() != 2 || s.size() != 2 || p.size() != 2 || !(d.empty() || d == std::vector<int64_t>{1, 1})) return std::nullopt;
  if (ceil && ceil->kind == Arg::Kind::Bool && ceil->b) return std::nullopt;
  if (ceil && ceil->kind != Arg::Kind::Bool && ceil->kind != Arg::Kind::None) return std::nullopt;
  for (int64_t v : {k[0], k[1], s[0], s[1]})
    if (v <= 0 || v > 64) return std::nullopt;
  if (p[0] < 0 || p[1] < 0 || p[0] * 2 > k[0] || p[1] * 2 > k[1]) return std::nullopt;
  MaxPoolArgs a;
  a.input = *input;
  a.output = static_cast<uint32_t>(step.outputs[0]);
  a.indices = indices;
  a.kh = static_cast<int>(k[0]), a.kw = static_cast<int>(k[1]), a.sh = static_cast<int>(s[0]), a.sw = static_cast<int>(s[1]);
  a.ph = static_cast<int>(p[0]), a.pw = static_cast<int>(p[1]);
  return a;
}

namespace cpu {
namespace {

// ATen's rule: the larger value, or a NaN, replaces the running max; a NaN stays. Without branches (`|`,
// not `||`): on random data a branch mispredicts half the time, and the fold below vectorizes.
inline float pick(float m, float v) { return ((v > m) | (v != v)) ? v : m; }

class MaxPool final : public FastPath {
 public:
  explicit MaxPool(const MaxPoolArgs& a) : a_(a) {}

  bool run(std::vector<c10::IValue>& buffers) const override {
    const at::Tensor* xp = buffer_tensor(buffers, a_.input);
    if (!xp) return false;
    const at::Tensor& x = *xp;
    if (!x.device().is_cpu() || x.dim() != 4 || x.scalar_type() != c10::kFloat || !x.is_contiguous()) return false;
    const int64_t n = x.size(0), c = x.size(1), h = x.size(2), w = x.size(3);
    const int64_t oh = (h + 2 * a_.ph - a_.kh) / a_.sh + 1, ow = (w + 2 * a_.pw - a_.kw) / a_.sw + 1;
    if (h + 2 * a_.ph < a_.kh || w + 2 * a_.pw < a_.kw || oh <= 0 || ow <= 0) return false;  // ATen's error
    if (a_.indices >= 0 && h * w >= std::numeric_limits<int32_t>::max()) return false;
    at::Tensor out = at::empty({n, c, oh, ow}, x.options());
    at::Tensor indices = a_.indices >= 0 ? at::empty({n, c, oh, ow}, x.options().dtype(c10::kLong)) : at::Tensor();
    const float* in = x.const_data_ptr<float>();
    float* o = out.mutable_data_ptr<float>();
    int64_t* ix = indices.defined() ? indices.mutable_data_ptr<int64_t>() : nullptr;
    const int64_t planes = n * c;
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, oh * ow));
    at::parallel_for(0, planes, grain, [&](int64_t begin, int64_t end) {
      const int64_t wp = w + 2 * a_.pw;
      std::vector<float> row(static_cast<size_t>(wp), -std::numeric_limits<float>::infinity()), hm(static_cast<size_t>(wp));
      std::vector<int32_t> pos(ix ? static_cast<size_t>(ow) : 0);
      for (int64_t plane = begin; plane < end; ++plane) {
        if (ix) pool_plane_with_indices(in + plane * h * w, o + plane * oh * ow, ix + plane * oh * ow, h, w, oh, ow, hm.data(), pos.data());
        else pool_plane(in + plane * h * w, o + plane * oh * ow, h, w, oh, ow, row.data(), hm.data());
      }
    });
    buffers[a_.output] = std::move(out);
    if (ix) buffers[static_cast<uint32_t>(a_.indices)] = std::move(indices);
    calls_.fetch_add(1, std::memory_order_relaxed);
    return true;
  }

  std::string describe() const override {
    return "cpu max pool " + std::to_string(a_.kh) + "x" + std::to_string(a_.kw) +
           (a_.indices >= 0 ? " with indices (" : " without indices (") +
           std::to_string(calls_.load(std::memory_order_relaxed)) + " calls)";
  }

 private:
  // `row` holds w + 2 * pw floats, `hm` as many: per output row, the window's rows folded into one (its
  // padding -inf), then the max over each run of kw columns, then every sw-th of those. Each loop runs
  // over contiguous floats and vectorizes.
  void pool_plane(const float* in, float* out, int64_t h, int64_t w, int64_t oh, int64_t ow, float* row, float* hm) const {
    const int64_t runs = (ow - 1) * a_.sw + 1;  // at most w + 2 * pw - kw + 1
    float* inner = row + a_.pw;
    for (int64_t y = 0; y < oh; ++y) {
      const int64_t top = y * a_.sh - a_.ph;
      const int64_t y0 = std::max<int64_t>(top, 0), y1 = std::min<int64_t>(top + a_.kh, h);
      std::copy(in + y0 * w, in + (y0 + 1) * w, inner);  // y0 < y1: padding is at most half the window
      for (int64_t r = y0 + 1; r < y1; ++r) {
        const float* src = in + r * w;
        for (int64_t x = 0; x < w; ++x) inner[x] = pick(inner[x], src[x]);
      }
      std::copy(row, row + runs, hm);
      for (int64_t i = 1; i < a_.kw; ++i) {
        const float* shifted = row + i;
        for (int64_t x = 0; x < runs; ++x) hm[x] = pick(hm[x], shifted[x]);
      }
      float* dst = out + y * ow;
      for (int64_t x = 0; x < ow; ++x) dst[x] = hm[x * a_.sw];
    }
  }

  // With indices (a training graph's backward reads them), each as ATen gives it: the flat position in the
  // plane of the first maximum in the window's row-major order, or of its last NaN; where every value is
  // -inf, the window's first. The window's elements are visited in that order for a row of outputs at a
  // time: each window column's values gathered into `v`, then compared for all outputs at once, with 32-bit
  // positions (run() checks a plane has fewer than 2^31 elements), so that the loop vectorizes.
  void pool_plane_with_indices(const float* in, float* out, int64_t* ix, int64_t h, int64_t w, int64_t oh, int64_t ow,
                               float* v, int32_t* pos) const {
    for (int64_t y = 0; y < oh; ++y) {
      const int64_t top = y * a_.sh - a_.ph;
      const int64_t y0 = std::max<int64_t>(top, 0), y1 = std::min<int64_t>(top + a_.kh, h);
      float* m = out + y * ow;
      for (int64_t x = 0; x < ow; ++x) {
        m[x] = -std::numeric_limits<float>::infinity();
        pos[x] = static_cast<int32_t>(y0 * w + std::max<int64_t>(x * a_.sw - a_.pw, 0));
      }
      for (int64_t r = y0; r < y1; ++r) {
        const float* src = in + r * w;
        for (int64_t j = 0; j < a_.kw; ++j) {
          // Outputs whose window column j lies inside the row: 0 <= x * sw - pw + j < w.
          const int64_t shift = j - a_.pw;
          const int64_t x0 = shift >= 0 ? 0 : (-shift + a_.sw - 1) / a_.sw;
          const int64_t last = w - 1 - shift;  // (a narrow row can end before column j)
          const int64_t x1 = last < 0 ? 0 : std::min<int64_t>(ow, last / a_.sw + 1);
          for (int64_t x = x0; x < x1; ++x) v[x] = src[x * a_.sw + shift];
          const int32_t base = static_cast<int32_t>(r * w + shift), step = a_.sw;
          for (int64_t x = x0; x < x1; ++x) {
            const bool take = (v[x] > m[x]) | (v[x] != v[x]);
            m[x] = take ? v[x] : m[x];
            pos[x] = take ? base + static_cast<int32_t>(x) * step : pos[x];
          }
        }
      }
      int64_t* at = ix + y * ow;
      for (int64_t x = 0; x < ow; ++x) at[x] = pos[x];
    }
  }

  MaxPoolArgs a_;
  mutable std::atomic<uint64_t> calls_{0};
};

std::shared_ptr<const FastPath> make_max_pool(const Node& n, const Step& step, const Tuning&) {
  std::optional<MaxPoolArgs> a = max_pool_args(n, step, /*cuda=*/false);
  if (!a) return nullptr;
  return std::make_shared<MaxPool>(*a);
}

const bool registered = (register_fast_path(&make_max_pool), true);

}  // namespace
}  // namespace cpu
}  // namespace ember
