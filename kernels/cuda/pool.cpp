// aten::max_pool2d_with_indices whose indices nothing reads, on CUDA, as an NVRTC kernel that writes
// the pooled values alone.
//  1. AOTAutograd turns every max_pool2d into max_pool2d_with_indices, and ATen's CUDA kernel writes an
//     int64 index beside every output even when the graph drops it: 8 of the 10 bytes a bf16 output
//     costs. resnet50 b64 bf16 channels_last on the H100: 222 us per call for its one pooling.
//  2. One thread per output element (per 16-byte vector of channels where the input is channels_last
//     with the channels contiguous and aligned), in the input's memory order, so neighbouring threads read
//     neighbouring bytes. The max follows ATen's rule: a NaN wins and stays. The raw bits of the winning
//     element are stored, so the output is exact.
//  3. A fast path of the plan (runtime.h): anything it was not made for (ceil_mode, dilation, another
//     dtype, NVRTC missing) runs ATen's op. The output's layout is the input's suggested memory format,
//     as ATen's.
//  4. The module (one per element size) starts loading when the plan is built: where neither the process
//     nor the disk cache holds it, NVRTC compiles it on a thread of its own, as the fused kernels'
//     (cuda_kernel.h), and calls meanwhile run ATen's op; a call being captured into a CUDA graph waits for
//     it. Compiled at the first call instead, it had held up resnet50 b64 bf16's first call by 0.33 s (H200,
//     torch.profiler).
#include "ember/error.h"
#include "ember/runtime.h"
#include "kernels/cuda/cuda_kernel.h"
#include "kernels/cuda/driver.h"
#include "kernels/pool_args.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <atomic>
#include <future>
#include <mutex>

namespace ember::cuda {
namespace {

// One module per element size: `b` the element's bytes (2 or 4), entries ember_max_pool (an element
// per thread) and ember_max_pool_vec (16 bytes of channels per thread).
std::string pool_source(int bytes, bool half) {
  const std::string raw = bytes == 2 ? "unsigned short" : "unsigned";
  std::string to_float;
  if (bytes == 4) to_float = "__uint_as_float(u)";
  else if (half) to_float = "h2f(u)";
  else to_float = "__uint_as_float((unsigned)u << 16)";
  std::string s;
  s += "typedef long long i64;\n";
  s += "struct alignas(16) Vec16 { unsigned a, b, c, d; };\n";
  s += "__device__ __forceinline__ float h2f(unsigned short u) { float f; asm(\"cvt.f32.f16 %0, %1;\" : \"=f\"(f) : \"h\"(u)); return f; }\n";
  s += "struct Params { const void* in; void* out; i64 n, c, h, w, oh, ow; i64 s[4]; i64 o[4]; int kh, kw, sh, sw, ph, pw, cl; };\n";
  s += "typedef " + raw + " raw_t;\n";
  s += std::string("#define NEG_INF ") + (bytes == 4 ? "0xff800000u" : (half ? "0xfc00" : "0xff80")) + "\n";
  s += "__device__ __forceinline__ float value(raw_t u) { return " + to_float + "; }\n";
  // V raw elements per thread; channels_last (cl) iterates channels fastest, else output columns.
  s += R"(template <int V> __device__ __forceinline__ void pool(const Params& p) {
  const i64 cv = p.c / V;
  const i64 total = p.n * cv * p.oh * p.ow;
  const raw_t* in = (const raw_t*)p.in;
  raw_t* out = (raw_t*)p.out;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
    i64 rest = i, c, x, y, n;
    if (p.cl) { c = rest % cv; rest /= cv; x = rest % p.ow; rest /= p.ow; y = rest % p.oh; n = rest / p.oh; }
    else { x = rest % p.ow; rest /= p.ow; y = rest % p.oh; rest /= p.oh; c = rest % cv; n = rest / cv; }
    c *= V;
    float best[V];
    raw_t bits[V];
#pragma unroll
    for (int v = 0; v < V; ++v) { best[v] = __int_as_float(0xff800000); bits[v] = NEG_INF; }
    const i64 y0 = y * p.sh - p.ph, x0 = x * p.sw - p.pw;
    for (int ky = 0; ky < p.kh; ++ky) {
      const i64 iy = y0 + ky;
      if (iy < 0 || iy >= p.h) continue;
      for (int kx = 0; kx < p.kw; ++kx) {
        const i64 ix = x0 + kx;
        if (ix < 0 || ix >= p.w) continue;
        const i64 off = n * p.s[0] + c * p.s[1] + iy * p.s[2] + ix * p.s[3];
        raw_t got[V];
        if (V == 1) {
          got[0] = in[off];
        } else {
          const Vec16 q = *(const Vec16*)(in + off);
          const raw_t* r = (const raw_t*)&q;
#pragma unroll
          for (int v = 0; v < V; ++v) got[v] = r[v];
        }
#pragma unroll
        for (int v = 0; v < V; ++v) {  // ATen's rule: larger, or NaN (which then stays)
          const float f = value(got[v]);
          if (f > best[v] || f != f) { best[v] = f; bits[v] = got[v]; }
        }
      }
    }
    const i64 o = n * p.o[0] + c * p.o[1] + y * p.o[2] + x * p.o[3];
    if (V == 1) {
      out[o] = bits[0];
    } else {
      Vec16 q;
      raw_t* r = (raw_t*)&q;
#pragma unroll
      for (int v = 0; v < V; ++v) r[v] = bits[v];
      *(Vec16*)(out + o) = q;
    }
  }
}
)";
  s += "extern \"C\" __global__ void ember_max_pool(Params p) { pool<1>(p); }\n";
  s += "extern \"C\" __global__ void ember_max_pool_vec(Params p) { pool<" + std::to_string(16 / bytes) + ">(p); }\n";
  return s;
}

struct Params {
  const void* in;
  void* out;
  int64_t n, c, h, w, oh, ow;
  int64_t s[4];
  int64_t o[4];
  int32_t kh, kw, sh, sw, ph, pw, cl;
};

class MaxPool final : public FastPath {
 public:
  MaxPool(uint32_t input, uint32_t output, int kh, int kw, int sh, int sw, int ph, int pw)
      : input_(input), output_(output), kh_(kh), kw_(kw), sh_(sh), sw_(sw), ph_(ph), pw_(pw) {}

  bool run(std::vector<c10::IValue>& buffers) const override {
    if (!buffers[input_].isTensor()) return false;
    const at::Tensor& x = buffers[input_].toTensor();
    const c10::ScalarType t = x.scalar_type();
    if (!x.is_cuda() || x.dim() != 4 || (t != c10::kFloat && t != c10::kHalf && t != c10::kBFloat16)) return false;
    const int64_t n = x.size(0), c = x.size(1), h = x.size(2), w = x.size(3);
    const int64_t oh = (h + 2 * ph_ - kh_) / sh_ + 1, ow = (w + 2 * pw_ - kw_) / sw_ + 1;
    if (h + 2 * ph_ < kh_ || w + 2 * pw_ < kw_ || oh <= 0 || ow <= 0) return false;  // ATen's error
    const int device = x.get_device();
    c10::Device dev(c10::kCUDA, static_cast<c10::DeviceIndex>(device));
    void* stream = c10::impl::getDeviceGuardImpl(c10::kCUDA)->getStream(dev).native_handle();
    void* const* functions = entries(slot_of(t), device, stream);
    if (!functions) return false;
    const at::MemoryFormat format = x.suggest_memory_format();
    at::Tensor out = at::empty({n, c, oh, ow}, x.options().memory_format(format));
    if (out.numel() > 0) {
      Params p{};
      p.in = x.data_ptr();
      p.out = out.data_ptr();
      p.n = n, p.c = c, p.h = h, p.w = w, p.oh = oh, p.ow = ow;
      for (int d = 0; d < 4; ++d) p.s[d] = x.stride(d), p.o[d] = out.stride(d);
      p.kh = kh_, p.kw = kw_, p.sh = sh_, p.sw = sw_, p.ph = ph_, p.pw = pw_;
      p.cl = format == at::MemoryFormat::ChannelsLast ? 1 : 0;
      // 16 bytes of channels per thread: channels contiguous in both, every offset a multiple of them.
      const int64_t per = 16 / static_cast<int64_t>(x.element_size());
      bool vec = p.cl && x.stride(1) == 1 && out.stride(1) == 1 && c % per == 0;
      for (int d : {0, 2, 3}) vec = vec && x.stride(d) % per == 0 && out.stride(d) % per == 0;
      vec = vec && reinterpret_cast<uintptr_t>(p.in) % 16 == 0 && reinterpret_cast<uintptr_t>(p.out) % 16 == 0;
      const int64_t total = n * (vec ? c / per : c) * oh * ow;
      const int64_t threads = 256;
      const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((total + threads - 1) / threads,
                                                                    static_cast<int64_t>(multiprocessor_count(device)) * 8));
      c10::DeviceGuard guard(dev);
      launch(functions[vec ? 1 : 0], static_cast<unsigned>(blocks), static_cast<unsigned>(threads), stream, &p, device);
    }
    buffers[output_] = std::move(out);
    calls_.fetch_add(1, std::memory_order_relaxed);
    return true;
  }

  std::string describe() const override {
    return "cuda max pool " + std::to_string(kh_) + "x" + std::to_string(kw_) + " without indices (" +
           std::to_string(calls_.load(std::memory_order_relaxed)) + " calls)";
  }

 public:
  // The module slot of an element type: float, half, bfloat16.
  static int slot_of(c10::ScalarType t) { return t == c10::kFloat ? 0 : (t == c10::kHalf ? 1 : 2); }

  // Starts loading the module of an element type for `device`, once per process for all pools of the type
  // (identical sources compile once, driver.cpp): from the process or the disk cache now, else with NVRTC on
  // a thread of its own unless EMBER_CUDA_BACKGROUND=0 (then now).
  static void start(int slot, int device) {
    if (device < 0 || device >= kDevices) return;
    Loaded& l = loaded(slot, device);
    std::call_once(l.once, [&l, slot, device] {
      auto load = [&l, slot, device] {
        try {
          l.functions = compile(pool_source(slot == 0 ? 4 : 2, slot == 1), std::vector<std::string>{"ember_max_pool", "ember_max_pool_vec"}, device);
        } catch (const std::exception&) {
          l.functions.clear();  // ATen's op runs
        }
        l.ready.store(true, std::memory_order_release);
      };
      if (background_compiles() && !has_image(pool_source(slot == 0 ? 4 : 2, slot == 1), device))
        l.pending = start_background_compile(load);
      else
        load();
    });
  }

  // The module's two functions; null while it compiles (unless `stream` is being captured: then after its
  // compile) or where NVRTC failed.
  static void* const* entries(int slot, int device, void* stream) {
    if (device < 0 || device >= kDevices) return nullptr;
    start(slot, device);
    Loaded& l = loaded(slot, device);
    if (!l.ready.load(std::memory_order_acquire)) {
      if (!capturing(stream)) return nullptr;
      l.pending.wait();
    }
    return l.functions.size() == 2 ? l.functions.data() : nullptr;
  }

 private:
  static constexpr int kDevices = 16;
  struct Loaded {
    std::once_flag once;
    std::atomic<bool> ready{false};
    std::vector<void*> functions;  // written once, before ready
    std::shared_future<void> pending;
  };
  static Loaded& loaded(int slot, int device) {
    static Loaded all[3][kDevices];
    return all[slot][device];
  }

  uint32_t input_, output_;
  int kh_, kw_, sh_, sw_, ph_, pw_;
  mutable std::atomic<uint64_t> calls_{0};
};

std::shared_ptr<const FastPath> make_max_pool(const Node& n, const Step& step, const Tuning&) {
  std::optional<MaxPoolArgs> a = max_pool_args(n, step, /*cuda=*/true);
  if (!a || a->indices >= 0) return nullptr;  // read indices (training): ATen's op writes them
  // max_pool_args checked that the input is a 4-D CUDA tensor value.
  const TensorType& t = n.args[0].value->type.tensor;
  if (t.dtype == c10::kFloat || t.dtype == c10::kHalf || t.dtype == c10::kBFloat16)
    MaxPool::start(MaxPool::slot_of(t.dtype), t.device.has_index() ? t.device.index() : 0);
  return std::make_shared<MaxPool>(a->input, a->output, a->kh, a->kw, a->sh, a->sw, a->ph, a->pw);
}

const bool registered = (register_fast_path(&make_max_pool), true);

}  // namespace
}  // namespace ember::cuda
