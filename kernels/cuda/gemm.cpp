// CUDA GEMMs as one cuBLASLt call with a plan made once (a FastPath for aten::mm, aten::addmm with a row
// bias, and aten::_addmm_activation; runtime.h).
//  1. Why: ATen's addmm builds cuBLASLt descriptors and asks cuBLASLt's heuristic for an algorithm on every
//     call, and its mm goes through cuBLAS's own per-call selection; for small f32 shapes the pick is split-K
//     (3 kernels and a memset). On the H100 host that cost 35-40 us of host time per GEMM (20 x Linear(100,100)
//     at batch 32: 737 us per call through ATen in ember, 824 us in eager, same process), several times the
//     GPU time of such a GEMM; through this path with one-kernel algorithms, 306 us. Here the descriptors,
//     layouts and algorithm are made at the first call of a step and reused: a call is the operand checks,
//     the output (and workspace) allocation and cublasLtMatmul.
//  2. Layout: ATen's tensors are row-major, cuBLASLt's column-major, so the call computes out^T = B^T A^T:
//     out [M, N] contiguous is the column-major N x M result with leading dimension N, and each operand is
//     handed over as the memory it is, transposed (op T) or not (op N) to give B^T and A^T. Operands whose
//     rows and columns are both strided stay with ATen.
//  3. For f32/f16/bf16 operands on one CUDA device, a contiguous result, beta = alpha = 1, a contiguous 1-D bias
//     of the result's width. Sizes and strides the IR knows as constants make one plan; symbolic ones (a graph
//     Dynamo made dynamic) one plan per concrete problem, made at its second call (PerSizeGemm). Per call the
//     operands must have exactly the plan's sizes and strides and 16-byte aligned data (what the algorithm was
//     chosen for); anything else, and the settings eager would honour differently (TF32 per
//     torch.backends.cuda.matmul.allow_tf32, which picks the compute type; disallowed reduced-precision
//     reductions or fp16 accumulation; deterministic algorithms), runs ATen's op instead.
//  4. cuBLASLt applies bias, ReLU and tanh-GELU in its epilogue, as ATen's Lt path does. Split-K algorithms
//     are kept for K-dominated shapes only (split_k_allowed). EMBER_CUBLASLT=0 leaves every GEMM to ATen.
//  5. Thread safety: one plan per step and compute type, made under the step's mutex, which is also held
//     while the bias pointer is set on the shared descriptor and the GEMM is launched.
//  6. Algorithm: cuBLASLt's heuristic ranks algorithms by a model, and its first pick can be far from the
//     fastest. On the H100 (f32, TF32 off) BERT-base b8 s128 spent 5.76 ms per call in GEMMs through the
//     heuristic's picks (eager's too: 128x64 tiles for the biased projections) against 4.65 ms in inductor's
//     plain mm calls; GPT-2's 512x768x3072 projection took 131 us per call where a split-K algorithm takes
//     56 + 5 us. So at a step's first call its problem is timed once per process (choose_algorithm): the
//     heuristic's first kCandidates algorithms, each run a few times on the step's own operands between
//     CUDA events, and the fastest kept, every step with the same problem reusing it. Not while a CUDA
//     graph is being captured (a synchronizing timer cannot run there): the heuristic's pick then.
//     For a plain or biased GEMM the candidates also include cuBLASLt without the epilogue plus ATen's
//     bias add, ATen's mm (cuBLAS's own kernels) plus the add, and for results whose rows are not 16-byte
//     multiples a zero-padded weight (Route); small penalties stand for their extra host time, except in
//     the warm-up before a CUDA graph capture (warming_for_graphs), whose replays launch nothing from the
//     host. Each measurement starts behind an untimed run so the GPU never waits for the host, and each
//     run starts with the L2 evicted, as a model's weights are (time_runs). EMBER_GEMM_ROUTE=
//     lt|lt_bias|aten|padded forces one (tests run each). Each route's first candidate is always
//     timed, the others within a wall-time budget (kTuningWallMs: their first runs load kernels).
//  7. ember's own kernels (kernels/cuda/gemm_kernels.cu, built by nvcc with libember): for problems of at
//     most kKernelMaxMacs multiply-adds, each of their configurations is one more candidate (Route::Kernel).
//     On the H100 host a plan step through the prepared cuBLASLt call took 17.4 us of host time (20 x
//     Linear(100,100) at batch 32, device idle before each call), through ember's kernel 7.9 us; a single
//     100x100x100 mm graph called without Dynamo, 11.2 against 6.1 us. Such GEMMs take less GPU time than
//     that (8 us for cuBLASLt and for the t16 kernel at 32x100x100, L2 evicted), so the host time is their
//     time in a graph of them. Outside graph capture a kernel is therefore chosen when max(its GPU time,
//     kKernelHostMs) beats max(the best cuBLASLt candidate's score, kLtHostMs); in the warm-up for a
//     capture, on GPU time alone. Beyond latency-bound sizes cuBLAS wins on arithmetic (64x1024x1024 f32
//     without epilogue: k16 20 us, ATen's mm 14 us), so larger problems are never timed with them. EMBER_GEMM_ROUTE=kernel forces the
//     route, EMBER_GEMM_KERNEL=t64|t32|t16|s4|s16|k16|k32 one configuration (tests run each).
//  8. Choices persist, and mode="max-autotune" tunes harder. A timed problem's winner, with every candidate's
//     time, is written to <cache dir>/gemm (gemm_record.h), keyed by the problem, the device's name,
//     architecture and SM count, cuBLASLt's and ember's versions and the tuning level; a later process reads
//     it where it would time (once per problem) and trusts it only once it checks out here (usable: a route the
//     step offers, cublasLtMatmulAlgoCheck for a cuBLASLt algorithm). EMBER_CACHE_DIR=off keeps nothing.
//     max-autotune (Tuning::exhaustive) times every candidate: kExhaustiveCandidates algorithms per descriptor
//     without split-K and as many with it, every ember kernel that can run the problem, padding at any size,
//     none cut by kTuningBudgetMs or kTuningWallMs; a candidate whose first run takes over 4x the fastest so far
//     runs no more. The graph's autotune_budget_s bounds it all: once spent, the problem being timed keeps its
//     best so far (for its step only, neither kept in the process nor written) and later problems get the
//     default's choice. ember.explain lists each timed problem's candidates and winner (tuning()).
#include "ember/config.h"
#include "ember/error.h"
#include "ember/runtime.h"
#include "kernels/cuda/disk_cache.h"
#include "kernels/cuda/driver.h"
#include "kernels/cuda/gemm_record.h"
#include "kernels/cuda/timing.h"

#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace ember::cuda {

#ifdef EMBER_GEMM_KERNELS
const void* gemm_kernels_image();  // kernels/cuda/gemm_image.cpp
#endif

namespace {

constexpr size_t kMaxWorkspace = size_t{4} << 20;
constexpr uintptr_t kAlignment = 16;

enum class Epilogue : uint8_t { None, Bias, ReluBias, GeluBias };

// A row-major [rows, cols] matrix with strides (s0, s1) as cuBLASLt sees its transpose: the stored
// column-major matrix (rows x cols, leading dimension ld) and whether the call transposes it.
struct Operand {
  uint64_t rows = 0, cols = 0;
  int64_t ld = 0;
  bool transpose = false;
};

std::optional<Operand> transposed_view(int64_t rows, int64_t cols, int64_t s0, int64_t s1) {
  if ((cols == 1 || s1 == 1) && (rows == 1 || s0 >= cols))  // rows contiguous: memory is X^T column-major
    return Operand{static_cast<uint64_t>(cols), static_cast<uint64_t>(rows), rows == 1 ? cols : s0, false};
  if ((rows == 1 || s0 == 1) && (cols == 1 || s1 >= rows))  // columns contiguous: memory is X column-major
    return Operand{static_cast<uint64_t>(rows), static_cast<uint64_t>(cols), cols == 1 ? rows : s1, true};
  return std::nullopt;
}

bool ok(cublasStatus_t status) { return status == CUBLAS_STATUS_SUCCESS; }

cudaDataType_t cuda_type(c10::ScalarType t) {
  return t == c10::kFloat ? CUDA_R_32F : t == c10::kHalf ? CUDA_R_16F : CUDA_R_16BF;
}

bool is_one(const c10::IValue& v) {
  return v.isInt() ? v.toInt() == 1 : v.isDouble() ? v.toDouble() == 1.0 : false;
}

// Whether cuBLASLt may split K across blocks and reduce the parts: a second kernel (and often a memset)
// per GEMM, which costs more host time than small GEMMs take on the GPU. On the H100, 20 x Linear(100,100)
// at batch 32 ran in 320 us per call (synchronized) with one-kernel algorithms against 491 us with the
// heuristic's split-K choices and 557 us in eager. Allowed where K dwarfs the output (K >= 4096 and
// K >= 8 x max(M, N)), where too few output tiles would otherwise leave the GPU idle, and for problems of
// at least 2^28 multiply-adds (several microseconds of GPU time even in 16-bit), where the timing in
// choose_algorithm decides, with kSplitKPenaltyMs added for the extra launches.
bool split_k_allowed(int64_t m, int64_t n, int64_t k) {
  return (k >= 4096 && k >= 8 * std::max(m, n)) || double(m) * double(n) * double(k) >= double(int64_t{1} << 28);
}

constexpr int kCandidates = 8;             // heuristic results timed per problem and descriptor
constexpr float kTuningBudgetMs = 150.f;   // GPU time spent timing one problem, at most (roughly)
// Wall time the timing of one problem may take beyond each route's first candidate. The GPU-time budget
// above does not see the host's part: each cuBLASLt algorithm's first run loads its kernel (lazy module
// loading), and with up to 8 algorithms per descriptor a biased GEMM has ~18 candidates. Timing them
// all made BERT-base bf16's first run 1.0 s on the H100 host, 0.24 s with ATen's mm and no timing.
constexpr float kTuningWallMs = 30.f;
constexpr float kSplitKPenaltyMs = 0.003f;  // host time of a split-K algorithm's extra launches
// Exhaustive tuning (point 8): the heuristic's first kExhaustiveCandidates algorithms without split-K and as many
// with it, per descriptor.
constexpr int kExhaustiveCandidates = 32;

// Whether `algo` splits K (and so launches a reduction, often a memset too).
bool splits_k(const cublasLtMatmulAlgo_t& algo) {
  uint32_t splits = 1;
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits, sizeof(splits), &written) !=
      CUBLAS_STATUS_SUCCESS)
    return false;
  return splits > 1;
}

// Process-wide choices: a problem (sizes, strides, dtype, epilogue, compute type, device, forced route and
// kernel, for CUDA graphs or not, tuning level) is timed once.
using ProblemKey = std::array<int64_t, 14>;
constexpr size_t kDeviceField = 10;  // the device's index: not part of the key on disk, which names the device
enum class Level : uint8_t { Default, Exhaustive };
// How a problem runs: one cuBLASLt call with the bias (and activation) in its epilogue; cuBLASLt without
// the epilogue, then the bias added by ATen; or ATen's mm (cuBLAS's own choice, whose kernels cuBLASLt's
// heuristic does not offer: inductor's plain mm calls ran BERT-base f32's projections in 55 us where the
// biased cuBLASLt pick took 70 us) and the bias added by ATen.
// Padded: for results whose rows are not a 16-byte multiple (GPT-2's vocabulary of 50257), the weight's
// rows are copied into a zero-padded matrix, ATen's mm writes a padded result and its leading columns are
// copied out. cuBLAS(Lt) keeps align-1 kernels for such widths: the bf16 LM head of GPT-2 b16 s512
// (8192x50257x768) took 6.1 ms on the H100, and 0.92 ms padded to 50264 (before the two copies, each a
// pass over its matrix). Offered for problems of at least kPaddedMinMacs multiply-adds only.
enum class Route : uint8_t { Lt, LtThenBias, Aten, Padded, Kernel };
constexpr size_t kRoutes = 5;
constexpr double kPaddedMinMacs = double(int64_t{1} << 26);

// EMBER_GEMM_ROUTE, read when a step's plan is made: -1 (none forced) or a Route.
int forced_route() {
  const std::optional<std::string> v = config_value("EMBER_GEMM_ROUTE");
  if (!v) return -1;
  const std::string& r = *v;
  return r == "lt" ? 0 : r == "lt_bias" ? 1 : r == "aten" ? 2 : r == "padded" ? 3 : r == "kernel" ? 4 : -1;
}
struct Choice {
  Route route = Route::Lt;
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;
  int config = 0;            // Route::Kernel: index into kKernelConfigs
  void* function = nullptr;  // Route::Kernel: its entry point for the problem's dtype and device
  std::string name;          // for ember.explain: "lt#2 split-K", "aten", "kernel t16"
};
static_assert(sizeof(cublasLtMatmulAlgo_t) == sizeof(GemmRecord::algo), "a record holds the algorithm's bytes");

// A problem's choice and what it was made from, shared by the steps with that problem (tuned()); ember.explain
// lists it (FastPath::tuning).
struct Tuned {
  Choice choice;
  Level level = Level::Default;
  bool from_disk = false;
  std::vector<std::pair<std::string, float>> timings;  // each candidate timed and its ms (negative: could not run)
};

// ember's GEMM kernels (point 7; the entry points of kernels/cuda/gemm_kernels.cu): a tile of rows x cols
// outputs per block (k16, k32: with K split over groups of the block's threads), or `skinny`: up to
// `rows` rows, two columns per warp of four per block, for a K-contiguous B. Timed only for problems of
// at least min_rows rows and min_k of K (a 64-row tile over a handful of rows, or split K over one
// chunk, is never the fastest).
struct KernelConfig {
  const char* name;
  bool skinny;
  int rows, cols, threads;
  int64_t min_rows = 0, min_k = 0;
};
constexpr KernelConfig kKernelConfigs[] = {
    {"t64", false, 64, 64, 256, 32}, {"t32", false, 32, 64, 256}, {"t16", false, 16, 32, 128},
    {"s4", true, 4, 8, 128},         {"s16", true, 16, 8, 128},   {"k16", false, 16, 32, 512, 0, 256},
    {"k32", false, 32, 64, 512, 0, 256},
};
constexpr size_t kKernelConfigCount = sizeof(kKernelConfigs) / sizeof(kKernelConfigs[0]);
constexpr double kKernelMaxMacs = double(int64_t{1} << 26);
constexpr float kKernelHostMs = 0.006f;  // a plan step launching ember's kernel (point 7)
constexpr float kLtHostMs = 0.015f;      // a plan step through the prepared cuBLASLt call

// The kernel argument, as gemm_kernels.cu declares it.
struct GemmParams {
  const void* a;
  const void* b;
  const void* bias;
  void* out;
  int64_t m, n, k;
  int64_t sa0, sa1, sb0, sb1;
  int act;
};

// The kernels' functions on `device`, [config][f32, f16, bf16]; empty where this build has none or the
// device cannot load them (an architecture the fatbin holds no code for).
const std::vector<void*>& kernel_functions(int device) {
  static std::mutex mu;
  static std::map<int, std::vector<void*>> loaded;
  std::lock_guard<std::mutex> lock(mu);
  auto [it, fresh] = loaded.try_emplace(device);
#ifdef EMBER_GEMM_KERNELS
  if (fresh) {
    std::vector<std::string> names;
    for (const KernelConfig& c : kKernelConfigs)
      for (const char* dtype : {"f32", "f16", "bf16"}) names.push_back(std::string("ember_gemm_") + c.name + "_" + dtype);
    try {
      it->second = load_image(gemm_kernels_image(), names, device);
    } catch (const std::exception&) {
      it->second.clear();
    }
  }
#endif
  return it->second;
}

// EMBER_GEMM_KERNEL, read when a step's plan is made: -1 (none forced) or an index into kKernelConfigs.
int forced_kernel() {
  const std::optional<std::string> v = config_value("EMBER_GEMM_KERNEL");
  if (!v) return -1;
  for (size_t i = 0; i < kKernelConfigCount; ++i)
    if (*v == kKernelConfigs[i].name) return static_cast<int>(i);
  return -1;
}
// Host time the timing does not see where the GPU is the bottleneck, but a graph of small GEMMs pays.
constexpr float kSeparateBiasPenaltyMs = 0.002f;  // the extra bias launch
constexpr float kAtenPenaltyMs = 0.004f;          // ATen's mm over a prepared cuBLASLt call
constexpr float kPaddedPenaltyMs = 0.008f;        // and the padding and copy-out launches
std::mutex tuned_mutex;
std::map<ProblemKey, std::shared_ptr<const Tuned>>& tuned() {
  static auto* choices = new std::map<ProblemKey, std::shared_ptr<const Tuned>>();  // never freed: outlives every plan
  return *choices;
}

template <class Option>
bool reduced_precision_allowed(Option option) {
  if constexpr (std::is_same_v<Option, bool>) return option;
  else return static_cast<int>(option) == 0;  // CuBLASReductionOption::AllowReducedPrecisionWithSplitK
}

class LtGemm final : public FastPath {
 public:
  struct Shape {
    int64_t m = 0, n = 0, k = 0;
    int64_t a_strides[2] = {0, 0}, b_strides[2] = {0, 0};
    c10::ScalarType dtype = c10::kFloat;
    c10::DeviceIndex device = 0;
    Epilogue epilogue = Epilogue::None;
  };

  LtGemm(Shape shape, uint32_t a, uint32_t b, int32_t bias, int32_t out, Operand first, Operand second, Tuning tuning)
      : s_(shape), a_(a), b_(b), bias_(bias), out_(out), first_(first), second_(second), tuning_(std::move(tuning)) {}

  ~LtGemm() override {
    for (Prepared& p : prepared_) p.release();
  }

  bool run(std::vector<c10::IValue>& buffers) const override {
    const at::Tensor* a = buffer_tensor(buffers, a_);
    const at::Tensor* b = buffer_tensor(buffers, b_);
    const at::Tensor* bias = bias_ >= 0 ? buffer_tensor(buffers, static_cast<uint32_t>(bias_)) : nullptr;
    if (!a || !b || (bias_ >= 0 && !bias)) return false;
    if (!matches(*a, s_.m, s_.k, s_.a_strides) || !matches(*b, s_.k, s_.n, s_.b_strides)) return false;
    if (bias && (bias->dim() != 1 || bias->size(0) != s_.n || bias->stride(0) != 1 || !aligned(*bias) ||
                 bias->scalar_type() != s_.dtype || bias->device() != a->device()))
      return false;
    at::Context& ctx = at::globalContext();
    if (ctx.deterministicAlgorithms()) return false;
    bool tf32 = false;
    if (s_.dtype == c10::kFloat) tf32 = ctx.allowTF32CuBLAS();
    else if (s_.dtype == c10::kHalf && (!reduced_precision_allowed(ctx.allowFP16ReductionCuBLAS()) || ctx.allowFP16AccumulationCuBLAS()))
      return false;
    else if (s_.dtype == c10::kBFloat16 && !reduced_precision_allowed(ctx.allowBF16ReductionCuBLAS()))
      return false;

    c10::cuda::CUDAGuard guard(s_.device);
    std::lock_guard<std::mutex> lock(mutex_);
    Prepared& p = prepared_[tf32 ? 1 : 0];
    cublasLtHandle_t handle = nullptr;  // ember's kernels need none (fetching it costs ~1 us)
    if (!p.tried || p.choice.route != Route::Kernel) handle = at::cuda::getCurrentCUDABlasLtHandle();
    if (!p.tried) prepare(p, handle, tf32, *a, *b, bias);
    if (!p.ok) return false;
    at::Tensor out = at::empty({s_.m, s_.n}, a->options());
    at::Tensor workspace;
    if (p.choice.workspace > 0)
      workspace = at::empty({static_cast<int64_t>(p.choice.workspace)}, a->options().dtype(at::kByte));
    if (bias && p.choice.route == Route::Lt) {
      const void* ptr = bias->data_ptr();
      if (cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &ptr, sizeof(ptr)) !=
          CUBLAS_STATUS_SUCCESS)
        return false;
    }
    if (!launch(p, p.choice, handle, *a, *b, bias, out, workspace.defined() ? workspace.data_ptr() : nullptr,
                at::cuda::getCurrentCUDAStream(s_.device).stream()))
      return false;  // nothing was launched: ATen's op runs instead
    buffers[out_] = std::move(out);
    calls_.fetch_add(1, std::memory_order_relaxed);
    return true;
  }

  // "512x768x3072 f32 +bias: lt#3 split-K 56.1 us (max-autotune); 70 timed: lt#3 split-K 56.1 us, lt#0 58.0 us, ...,
  // 60 more up to 410.2 us, 2 could not run": each compute type's problem whose choice was timed (here or by an
  // earlier process, "from disk"), its fastest kTuningListed candidates by GPU time (the winner's score also
  // counts host time, so it need not be the first).
  std::vector<std::string> tuning() const override {
    static constexpr size_t kTuningListed = 10;
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::string> out;
    for (size_t i = 0; i < 2; ++i) {
      const Prepared& p = prepared_[i];
      if (!p.ok || !p.tuned || p.tuned->timings.empty()) continue;
      const Tuned& t = *p.tuned;
      static const char* const kDtypes[] = {"f32", "f16", "bf16"};
      static const char* const kEpilogues[] = {"", " +bias", " +bias relu", " +bias gelu"};
      std::vector<std::pair<std::string, float>> ran;
      size_t failed = 0;
      std::string line = problem() + " " + kDtypes[dtype_index()] + kEpilogues[static_cast<size_t>(s_.epilogue)] +
                         (i == 1 ? " tf32" : "") + ": " + t.choice.name;
      for (const auto& [name, ms] : t.timings) {
        if (name == t.choice.name) line += " " + microseconds(ms);
        if (ms < 0.f) ++failed;
        else ran.emplace_back(name, ms);
      }
      std::stable_sort(ran.begin(), ran.end(), [](const auto& x, const auto& y) { return x.second < y.second; });
      line += std::string(" (") + (t.level == Level::Exhaustive ? "max-autotune" : "default") +
              (t.from_disk ? ", from disk" : "") + "); " + std::to_string(t.timings.size()) + " timed: ";
      for (size_t j = 0; j < ran.size() && j < kTuningListed; ++j)
        line += (j ? ", " : "") + ran[j].first + " " + microseconds(ran[j].second);
      if (ran.size() > kTuningListed)
        line += ", " + std::to_string(ran.size() - kTuningListed) + " more up to " + microseconds(ran.back().second);
      if (failed) line += (ran.empty() ? "" : ", ") + std::to_string(failed) + " could not run";
      out.push_back(std::move(line));
    }
    return out;
  }

  uint64_t calls() const { return calls_.load(std::memory_order_relaxed); }
  std::string problem() const { return std::to_string(s_.m) + "x" + std::to_string(s_.n) + "x" + std::to_string(s_.k); }

  std::string describe() const override {
    const Route route = prepared_[0].tried ? prepared_[0].choice.route : prepared_[1].choice.route;
    if (route == Route::Kernel) {
      const Choice& c = prepared_[0].tried ? prepared_[0].choice : prepared_[1].choice;
      return std::string("ember gemm kernel ") + kKernelConfigs[c.config].name + " " + std::to_string(s_.m) + "x" +
             std::to_string(s_.n) + "x" + std::to_string(s_.k) + ", " +
             std::to_string(calls_.load(std::memory_order_relaxed)) + " calls";
    }
    const char* how = route == Route::Lt           ? ""
                      : route == Route::LtThenBias ? " (bias added after)"
                      : route == Route::Aten       ? " (timed: ATen's mm faster)"
                                                   : " (timed: rows padded to 16 bytes)";
    return "cublasLt " + std::to_string(s_.m) + "x" + std::to_string(s_.n) + "x" + std::to_string(s_.k) + how + ", " +
           std::to_string(calls_.load(std::memory_order_relaxed)) + " calls";
  }

 private:
  struct Prepared {
    bool tried = false, ok = false;
    bool described = false;  // desc (and plain) and the layouts made
    cublasLtMatmulDesc_t desc = nullptr;   // with the step's epilogue
    cublasLtMatmulDesc_t plain = nullptr;  // without it (steps with a bias only)
    cublasLtMatrixLayout_t first = nullptr, second = nullptr, out = nullptr;
    Choice choice;
    std::shared_ptr<const Tuned> tuned;  // how choice was made (tuning())
    void release() {
      if (first) cublasLtMatrixLayoutDestroy(first);
      if (second) cublasLtMatrixLayoutDestroy(second);
      if (out) cublasLtMatrixLayoutDestroy(out);
      if (desc) cublasLtMatmulDescDestroy(desc);
      if (plain) cublasLtMatmulDescDestroy(plain);
      first = second = out = nullptr;
      desc = plain = nullptr;
    }
  };

  // One GEMM by route `c` into `out`; false when nothing was launched. For Route::Lt with a bias, the
  // bias pointer must be set on p.desc.
  bool launch(const Prepared& p, const Choice& c, cublasLtHandle_t handle, const at::Tensor& a, const at::Tensor& b,
              const at::Tensor* bias, at::Tensor& out, void* workspace, cudaStream_t stream) const {
    if (c.route == Route::Kernel) {
      const KernelConfig& k = kKernelConfigs[c.config];
      GemmParams params{a.data_ptr(), b.data_ptr(), bias ? bias->data_ptr() : nullptr, out.data_ptr(),
                        s_.m, s_.n, s_.k, s_.a_strides[0], s_.a_strides[1], s_.b_strides[0], s_.b_strides[1],
                        s_.epilogue == Epilogue::ReluBias ? 1 : s_.epilogue == Epilogue::GeluBias ? 2 : 0};
      unsigned blocks = 0, blocks_y = 1;
      if (k.skinny) {
        blocks = static_cast<unsigned>((s_.n + k.cols - 1) / k.cols);
      } else {
        blocks = static_cast<unsigned>((s_.n + k.cols - 1) / k.cols);
        blocks_y = static_cast<unsigned>((s_.m + k.rows - 1) / k.rows);
      }
      cuda::launch(c.function, blocks, static_cast<unsigned>(k.threads), stream, &params,
                   s_.device, blocks_y);
      return true;
    }
    if (c.route == Route::Aten) {
      at::mm_out(out, a, b);
      if (bias) out.add_(*bias);
      return true;
    }
    if (c.route == Route::Padded) {
      const int64_t n_pad = padded_width();
      at::Tensor weight = at::empty({n_pad, s_.k}, b.options());  // B^T with zero rows below
      weight.narrow(0, 0, s_.n).copy_(b.t());
      weight.narrow(0, s_.n, n_pad - s_.n).zero_();
      at::Tensor wide = at::empty({s_.m, n_pad}, a.options());
      if (bias) {
        at::Tensor wide_bias = at::zeros({n_pad}, bias->options());
        wide_bias.narrow(0, 0, s_.n).copy_(*bias);
        at::addmm_out(wide, wide_bias, a, weight.t());
      } else {
        at::mm_out(wide, a, weight.t());
      }
      out.copy_(wide.narrow(1, 0, s_.n));
      return true;
    }
    const float alpha = 1.f, beta = 0.f;
    cublasLtMatmulDesc_t desc = c.route == Route::LtThenBias ? p.plain : p.desc;
    if (cublasLtMatmul(handle, desc, &alpha, b.data_ptr(), p.first, a.data_ptr(), p.second, &beta, out.data_ptr(),
                       p.out, out.data_ptr(), p.out, &c.algo, workspace, c.workspace, stream) != CUBLAS_STATUS_SUCCESS)
      return false;
    if (c.route == Route::LtThenBias) out.add_(*bias);
    return true;
  }

  // The result's width rounded up to a 16-byte multiple; s_.n when it is one.
  int64_t padded_width() const {
    const int64_t per = static_cast<int64_t>(kAlignment) / static_cast<int64_t>(c10::elementSize(s_.dtype));
    return (s_.n + per - 1) / per * per;
  }

  static bool aligned(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % kAlignment == 0; }
  bool matches(const at::Tensor& t, int64_t rows, int64_t cols, const int64_t* strides) const {
    return t.dim() == 2 && t.layout() == at::kStrided && t.is_cuda() && t.get_device() == s_.device &&
           t.scalar_type() == s_.dtype && t.size(0) == rows && t.size(1) == cols && t.stride(0) == strides[0] &&
           t.stride(1) == strides[1] && aligned(t);
  }

  // Descriptors, layouts and the route and algorithm (choose); p.ok stays false when no candidate runs. Under
  // exhaustive tuning the choice is max-autotune's where that level makes one (point 8), else the default's.
  void prepare(Prepared& p, cublasLtHandle_t handle, bool tf32, const at::Tensor& a, const at::Tensor& b,
               const at::Tensor* bias) const {
    p.tried = true;
    const cudaDataType_t type = cuda_type(s_.dtype);
    cublasLtEpilogue_t epilogue = s_.epilogue == Epilogue::Bias       ? CUBLASLT_EPILOGUE_BIAS
                                  : s_.epilogue == Epilogue::ReluBias ? CUBLASLT_EPILOGUE_RELU_BIAS
                                  : s_.epilogue == Epilogue::GeluBias ? CUBLASLT_EPILOGUE_GELU_BIAS
                                                                      : CUBLASLT_EPILOGUE_DEFAULT;
    bool good = make_desc(&p.desc, tf32, epilogue);
    if (s_.epilogue == Epilogue::Bias) good = good && make_desc(&p.plain, tf32, CUBLASLT_EPILOGUE_DEFAULT);
    good = good && ok(cublasLtMatrixLayoutCreate(&p.first, type, first_.rows, first_.cols, first_.ld));
    good = good && ok(cublasLtMatrixLayoutCreate(&p.second, type, second_.rows, second_.cols, second_.ld));
    good = good && ok(cublasLtMatrixLayoutCreate(&p.out, type, static_cast<uint64_t>(s_.n), static_cast<uint64_t>(s_.m), s_.n));
    p.described = good;
    const int forced = forced_route();
    std::shared_ptr<const Tuned> t;
    if (tuning_.exhaustive) t = choose(p, handle, tf32, a, b, bias, Level::Exhaustive, forced);
    if (!t) t = choose(p, handle, tf32, a, b, bias, Level::Default, forced);
    if (!t) {
      p.release();
      return;
    }
    p.tuned = t;
    p.choice = t->choice;
    p.ok = true;
  }

  // The candidates choose() times at `level`, each route's first before the rest (a budget may run out before
  // the last), only the forced route's where one is forced (and has any). Default (point 6): the heuristic's
  // first kCandidates algorithms per descriptor, split-K ones where split_k_allowed; ember's kernels for small
  // problems (point 7); ATen's mm, and padding for large problems. Exhaustive (point 8): kExhaustiveCandidates
  // algorithms per descriptor without split-K and as many with it, every ember kernel that can run the
  // problem, padding at any size.
  std::vector<Choice> candidates(const Prepared& p, cublasLtHandle_t handle, Level level, int forced) const {
    const bool all = level == Level::Exhaustive;
    std::vector<Choice> found;
    for (auto [desc, route] : {std::pair{p.desc, Route::Lt}, std::pair{p.plain, Route::LtThenBias}}) {
      if (!p.described || !desc) continue;
      std::vector<Choice> algos;
      if (all) {
        algos = heuristic(handle, p, desc, route, kExhaustiveCandidates, false);
        for (Choice& c : heuristic(handle, p, desc, route, kExhaustiveCandidates, true))
          if (std::none_of(algos.begin(), algos.end(), [&](const Choice& x) { return same_algo(x.algo, c.algo); }))
            algos.push_back(c);
      } else {
        algos = heuristic(handle, p, desc, route, kCandidates, split_k_allowed(s_.m, s_.n, s_.k));
      }
      for (size_t i = 0; i < algos.size(); ++i)
        algos[i].name = std::string(route == Route::Lt ? "lt#" : "lt_bias#") + std::to_string(i) +
                        (splits_k(algos[i].algo) ? " split-K" : "");
      found.insert(found.end(), algos.begin(), algos.end());
    }
    const double macs = double(s_.m) * double(s_.n) * double(s_.k);
    const std::vector<void*>& functions = kernel_functions(s_.device);  // looked up here, not per call
    if ((all || macs <= kKernelMaxMacs || forced == static_cast<int>(Route::Kernel)) && !functions.empty()) {
      const int only = forced_kernel();
      for (size_t i = 0; i < kKernelConfigCount; ++i) {
        const KernelConfig& k = kKernelConfigs[i];
        // Correct for any strides; worth timing only where its loads are coalesced (skinny) or its tile
        // is not mostly empty (t64).
        const bool worth = s_.m >= k.min_rows && s_.k >= k.min_k && (!k.skinny || s_.b_strides[0] == 1 || s_.k == 1);
        if (kernel_can_run(k) && (only >= 0 ? static_cast<int>(i) == only : all || worth))
          found.push_back({Route::Kernel, {}, 0, static_cast<int>(i), functions[i * 3 + dtype_index()],
                           std::string("kernel ") + k.name});
      }
    }
    if (p.described && (s_.epilogue == Epilogue::None || s_.epilogue == Epilogue::Bias)) {
      found.push_back({Route::Aten, {}, 0, 0, nullptr, "aten"});
      const bool large = macs >= kPaddedMinMacs;
      if (padded_width() != s_.n && (all || large || forced == static_cast<int>(Route::Padded)))
        found.push_back({Route::Padded, {}, 0, 0, nullptr, "padded"});
    }
    std::vector<Choice> leaders, rest;
    std::array<bool, kRoutes> seen{};
    for (Choice& c : found) {
      bool& route_seen = seen[static_cast<size_t>(c.route)];
      (route_seen ? rest : leaders).push_back(std::move(c));
      route_seen = true;
    }
    leaders.insert(leaders.end(), std::make_move_iterator(rest.begin()), std::make_move_iterator(rest.end()));
    if (forced >= 0) {
      std::vector<Choice> only;
      for (const Choice& c : leaders)
        if (static_cast<int>(c.route) == forced) only.push_back(c);
      if (!only.empty()) return only;
    }
    return leaders;
  }

  bool kernel_can_run(const KernelConfig& k) const {
    return (k.skinny ? s_.m <= k.rows : (s_.m + k.rows - 1) / k.rows <= 65535) && (s_.n + k.cols - 1) / k.cols <= INT32_MAX;
  }
  size_t dtype_index() const { return s_.dtype == c10::kFloat ? 0 : s_.dtype == c10::kHalf ? 1 : 2; }
  static bool same_algo(const cublasLtMatmulAlgo_t& x, const cublasLtMatmulAlgo_t& y) {
    return std::memcmp(&x, &y, sizeof(x)) == 0;
  }
  static std::string microseconds(float ms) {
    if (ms < 0.f) return "could not run";
    char text[32];
    std::snprintf(text, sizeof(text), "%.1f us", double(ms) * 1e3);
    return text;
  }

  bool make_desc(cublasLtMatmulDesc_t* desc, bool tf32, cublasLtEpilogue_t epilogue) const {
    const cublasComputeType_t compute = tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    cublasOperation_t ta = first_.transpose ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasOperation_t tb = second_.transpose ? CUBLAS_OP_T : CUBLAS_OP_N;
    bool good = ok(cublasLtMatmulDescCreate(desc, compute, CUDA_R_32F));
    good = good && ok(cublasLtMatmulDescSetAttribute(*desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    good = good && ok(cublasLtMatmulDescSetAttribute(*desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    good = good && ok(cublasLtMatmulDescSetAttribute(*desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    if (epilogue != CUBLASLT_EPILOGUE_DEFAULT) {
      cudaDataType_t bias_type = cuda_type(s_.dtype);
      good = good && ok(cublasLtMatmulDescSetAttribute(*desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                                                       sizeof(bias_type)));
    }
    return good;
  }

  // The heuristic's first `count` algorithms for `desc` that run within the workspace limit; split-K ones only
  // where `split_k`.
  std::vector<Choice> heuristic(cublasLtHandle_t handle, const Prepared& p, cublasLtMatmulDesc_t desc, Route route,
                                int count, bool split_k) const {
    cublasLtMatmulPreference_t pref = nullptr;
    bool good = ok(cublasLtMatmulPreferenceCreate(&pref));
    size_t max_workspace = kMaxWorkspace;
    uint32_t alignment = kAlignment;
    good = good && ok(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                           &max_workspace, sizeof(max_workspace)));
    if (!split_k) {
      uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_NONE;
      good = good && ok(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes,
                                                             sizeof(schemes)));
    }
    for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
      good = good && ok(cublasLtMatmulPreferenceSetAttribute(pref, attr, &alignment, sizeof(alignment)));
    std::vector<cublasLtMatmulHeuristicResult_t> results(static_cast<size_t>(count));
    int returned = 0;
    good = good && ok(cublasLtMatmulAlgoGetHeuristic(handle, desc, p.first, p.second, p.out, p.out, pref, count,
                                                     results.data(), &returned));
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    std::vector<Choice> out;
    for (int i = 0; good && i < std::min(returned, count); ++i)
      if (results[i].state == CUBLAS_STATUS_SUCCESS && results[i].workspaceSize <= kMaxWorkspace)
        out.push_back({route, results[i].algo, results[i].workspaceSize});
    return out;
  }

  // The choice for this problem at `level` and what it was made from; null where `level` makes none (exhaustive
  // tuning while a graph is captured or past its budget: the default's choice follows) or no candidate runs.
  // Made once per process, by the first step with the problem: read from the disk where an earlier process
  // timed it, else by timing the candidates (points 6 and 8) and written to the disk. While a CUDA graph is
  // captured, and where there is one candidate, the first candidate untimed.
  std::shared_ptr<const Tuned> choose(Prepared& p, cublasLtHandle_t handle, bool tf32, const at::Tensor& a,
                                      const at::Tensor& b, const at::Tensor* bias, Level level, int forced) const {
    const bool exhaustive = level == Level::Exhaustive;
    const auto began = std::chrono::steady_clock::now();
    // Replays of a CUDA graph launch nothing from the host: host-time penalties do not apply to the
    // choice a warm-up for capture makes (warming_for_graphs), which is kept apart.
    const bool for_graphs = warming_for_graphs();
    const ProblemKey key = {s_.m, s_.n, s_.k, s_.a_strides[0], s_.a_strides[1], s_.b_strides[0], s_.b_strides[1],
                            static_cast<int64_t>(s_.dtype), static_cast<int64_t>(s_.epilogue), tf32, s_.device,
                            forced + 16 * (forced_kernel() + 1), for_graphs, static_cast<int64_t>(level)};
    {
      std::lock_guard<std::mutex> lock(tuned_mutex);
      auto it = tuned().find(key);
      if (it != tuned().end()) return it->second;
    }
    auto untimed = [&](const std::vector<Choice>& candidates) -> std::shared_ptr<const Tuned> {
      if (candidates.empty()) return nullptr;
      auto t = std::make_shared<Tuned>();
      t->choice = candidates[0];
      t->level = level;
      return t;
    };
    cudaStream_t stream = at::cuda::getCurrentCUDAStream(s_.device).stream();
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capturing) != cudaSuccess || capturing != cudaStreamCaptureStatusNone) {
      (void)cudaGetLastError();
      return exhaustive ? nullptr : untimed(candidates(p, handle, level, forced));
    }
    const std::string dir = disk_cache_dir();
    const std::string record = dir.empty() ? std::string() : record_key(key);
    if (std::shared_ptr<const Tuned> t = from_disk(p, handle, dir, record, level, forced)) {
      std::lock_guard<std::mutex> lock(tuned_mutex);
      return tuned().emplace(key, t).first->second;
    }
    if (exhaustive && (!tuning_.budget || !tuning_.budget->left())) {
      gemm_tuning_counters().over_budget.fetch_add(1);
      return nullptr;
    }
    const std::vector<Choice> candidates = this->candidates(p, handle, level, forced);
    if (candidates.size() <= 1) return untimed(candidates);

    size_t workspace_bytes = 0;
    for (const Choice& c : candidates) workspace_bytes = std::max(workspace_bytes, c.workspace);
    at::Tensor out = at::empty({s_.m, s_.n}, a.options());
    at::Tensor workspace = at::empty({static_cast<int64_t>(std::max<size_t>(workspace_bytes, 1))}, a.options().dtype(at::kByte));
    // Evicted before each timed run (time_runs).
    const at::Tensor flush = at::empty({l2_flush_bytes(s_.device)}, a.options().dtype(at::kByte));
    if (bias) {
      const void* ptr = bias->data_ptr();
      if (cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &ptr, sizeof(ptr)) !=
          CUBLAS_STATUS_SUCCESS)
        return untimed(candidates);
    }
    // The cuBLASLt/ATen candidates compete on their scores as they always did; the best kernel then
    // replaces the winner where it is faster with host time counted (point 7).
    Choice best = candidates[0], best_kernel;
    float best_ms = -1.f, kernel_ms = -1.f, fastest_ms = -1.f, spent_ms = 0.f;
    auto t = std::make_shared<Tuned>();
    t->level = level;
    bool cut_short = false;  // exhaustive tuning stopped by the graph's budget: not kept beyond this step
    // Candidates come each route's first, then the rest (candidates()): those leaders are always timed.
    std::array<bool, kRoutes> route_seen{};
    const auto start = std::chrono::steady_clock::now();
    auto charged = began;  // exhaustive: wall time up to here is charged to the budget
    for (const Choice& c : candidates) {
      bool& leader_seen = route_seen[static_cast<size_t>(c.route)];
      if (exhaustive) {
        const auto now = std::chrono::steady_clock::now();
        tuning_.budget->spend(std::chrono::duration<double>(now - charged).count());
        charged = now;
        if (!t->timings.empty() && !tuning_.budget->left()) {
          cut_short = true;
          break;
        }
      } else {
        if (spent_ms > kTuningBudgetMs) break;
        if (leader_seen && std::chrono::duration<float, std::milli>(std::chrono::steady_clock::now() - start).count() >
                               kTuningWallMs)
          break;
      }
      leader_seen = true;
      const float give_up = exhaustive && fastest_ms >= 0.f ? std::max(4.f * fastest_ms, 0.05f) : -1.f;
      float ms = time_runs([&] { return launch(p, c, handle, a, b, bias, out, workspace.data_ptr(), stream); }, stream,
                           flush.data_ptr(), static_cast<size_t>(flush.numel()), give_up);
      t->timings.emplace_back(c.name, ms);
      if (ms < 0.f) continue;
      if (fastest_ms < 0.f || ms < fastest_ms) fastest_ms = ms;
      spent_ms += 5.f * ms;
      if (c.route == Route::Kernel) {
        if (kernel_ms < 0.f || ms < kernel_ms) best_kernel = c, kernel_ms = ms;
        continue;
      }
      const float host = for_graphs ? 0.f : 1.f;
      if (c.route != Route::Aten && c.route != Route::Padded && splits_k(c.algo)) ms += host * kSplitKPenaltyMs;
      if (c.route == Route::LtThenBias) ms += host * kSeparateBiasPenaltyMs;
      if (c.route == Route::Aten) ms += host * kAtenPenaltyMs;
      if (c.route == Route::Padded) ms += host * kPaddedPenaltyMs;
      if (best_ms < 0.f || ms < best_ms) best = c, best_ms = ms;
    }
    if (exhaustive) tuning_.budget->spend(std::chrono::duration<double>(std::chrono::steady_clock::now() - charged).count());
    if (kernel_ms >= 0.f) {
      const bool kernel_wins = best_ms < 0.f || (for_graphs ? kernel_ms < best_ms
                                                            : std::max(kernel_ms, kKernelHostMs) < std::max(best_ms, kLtHostMs));
      if (kernel_wins) best = best_kernel;
    }
    t->choice = best;
    (exhaustive ? gemm_tuning_counters().autotuned : gemm_tuning_counters().timed).fetch_add(1);
    if (cut_short) return t;
    {
      std::lock_guard<std::mutex> lock(tuned_mutex);
      tuned().emplace(key, t);
    }
    if (!record.empty() && (best_ms >= 0.f || kernel_ms >= 0.f)) {  // not where nothing ran
      GemmRecord r;
      r.key = record;
      r.route = static_cast<uint8_t>(best.route);
      r.config = best.config;
      r.workspace = best.workspace;
      std::memcpy(r.algo.data(), &best.algo, sizeof(best.algo));
      r.winner = best.name;
      r.timings = t->timings;
      gemm_record_store(dir, r);  // best effort: a failed write costs the next process a timing
    }
    return t;
  }

  // The disk record's key for `key` (gemm_record.h): ember's version and this file's build (a rebuilt gemm.cpp
  // may choose differently: its candidates, penalties or launches changed), the device by name (not index),
  // cuBLASLt's version, whether ember's kernels could load, and every other field of the problem; "" where the
  // device cannot be named.
  std::string record_key(const ProblemKey& key) const {
    const std::string device = device_identity(s_.device);
    if (device.empty()) return "";
    std::string text = std::string("ember ") + EMBER_VERSION + " gemm 1 built " + __DATE__ + " " + __TIME__ +
                       "\ndevice " + device + "\ncublasLt " +
                       std::to_string(cublasLtGetVersion()) + "\nkernels " +
                       (kernel_functions(s_.device).empty() ? "0" : "1") + "\nproblem";
    for (size_t i = 0; i < key.size(); ++i)
      if (i != kDeviceField) text += " " + std::to_string(key[i]);
    return text;
  }

  // The choice an earlier process stored under `record`, where this step can run it (usable); counted either way.
  std::shared_ptr<const Tuned> from_disk(const Prepared& p, cublasLtHandle_t handle, const std::string& dir,
                                         const std::string& record, Level level, int forced) const {
    if (dir.empty() || record.empty()) return nullptr;
    const std::optional<GemmRecord> r = gemm_record_find(dir, record);
    if (!r) return nullptr;
    std::optional<Choice> choice = usable(*r, p, handle, forced);
    if (!choice) {
      gemm_tuning_counters().refused.fetch_add(1);
      return nullptr;
    }
    gemm_tuning_counters().from_disk.fetch_add(1);
    auto t = std::make_shared<Tuned>();
    t->choice = std::move(*choice);
    t->level = level;
    t->from_disk = true;
    t->timings = r->timings;
    return t;
  }

  // The choice record `r` holds, where this step can run it: a route it offers (ATen's and the padded one for
  // plain or biased GEMMs, the separate bias for biased ones), an ember kernel this build loaded for the device
  // whose configuration fits the problem, a cuBLASLt algorithm that cublasLtMatmulAlgoCheck accepts for the
  // step's own descriptors within the workspace limit. Anything else: nullopt (the problem is timed again).
  std::optional<Choice> usable(const GemmRecord& r, const Prepared& p, cublasLtHandle_t handle, int forced) const {
    if (r.route >= kRoutes || (forced >= 0 && r.route != forced)) return std::nullopt;
    Choice c;
    c.route = static_cast<Route>(r.route);
    c.name = r.winner;
    const bool plain_or_bias = s_.epilogue == Epilogue::None || s_.epilogue == Epilogue::Bias;
    switch (c.route) {
      case Route::Kernel: {
        const std::vector<void*>& functions = kernel_functions(s_.device);
        const int only = forced_kernel();
        if (r.config < 0 || static_cast<size_t>(r.config) >= kKernelConfigCount || functions.empty() ||
            !kernel_can_run(kKernelConfigs[r.config]) || (only >= 0 && only != r.config))
          return std::nullopt;
        c.config = r.config;
        c.function = functions[static_cast<size_t>(r.config) * 3 + dtype_index()];
        return c.function ? std::optional<Choice>(c) : std::nullopt;
      }
      case Route::Aten:
      case Route::Padded:
        return p.described && plain_or_bias ? std::optional<Choice>(c) : std::nullopt;
      case Route::Lt:
      case Route::LtThenBias: {
        const cublasLtMatmulDesc_t desc = c.route == Route::Lt ? p.desc : p.plain;
        if (!p.described || !desc || !handle || r.workspace > kMaxWorkspace) return std::nullopt;
        std::memcpy(&c.algo, r.algo.data(), sizeof(c.algo));
        cublasLtMatmulHeuristicResult_t result{};
        if (!ok(cublasLtMatmulAlgoCheck(handle, desc, p.first, p.second, p.out, p.out, &c.algo, &result)) ||
            !ok(result.state) || result.workspaceSize > kMaxWorkspace)
          return std::nullopt;
        c.workspace = std::max<size_t>(result.workspaceSize, r.workspace);
        return c;
      }
    }
    return std::nullopt;
  }

  Shape s_;
  uint32_t a_, b_;
  int32_t bias_, out_;
  Operand first_, second_;  // B^T and A^T as cuBLASLt takes them
  Tuning tuning_;            // the plan's (point 8)
  mutable std::mutex mutex_;
  mutable std::atomic<uint64_t> calls_{0};  // for describe(): tests check the fast path ran
  mutable Prepared prepared_[2];  // [0]: full f32 (or 16-bit) compute, [1]: TF32
};

// The GEMM of one concrete problem; null where cuBLASLt cannot take its operands as they lie in memory.
std::shared_ptr<LtGemm> concrete_gemm(const LtGemm::Shape& s, uint32_t a, uint32_t b, int32_t bias, int32_t out,
                                      const Tuning& tuning) {
  if (s.m == 0 || s.n == 0 || s.k == 0) return nullptr;
  std::optional<Operand> first = transposed_view(s.k, s.n, s.b_strides[0], s.b_strides[1]);   // B^T
  std::optional<Operand> second = transposed_view(s.m, s.k, s.a_strides[0], s.a_strides[1]);  // A^T
  if (!first || !second) return nullptr;
  return std::make_shared<LtGemm>(s, a, b, bias, out, *first, *second, tuning);
}

// A GEMM whose sizes or strides the IR holds as symbols (a graph Dynamo made dynamic): one LtGemm per concrete
// problem, with its plan and timed algorithm as a static step's, looked up per call by the operands' sizes and
// strides (the problem used last compared first, then a scan of at most kMaxProblems; no hashing). A problem
// gets its LtGemm at its second call, so that a size seen once (a serving run whose sizes never repeat) pays
// no timing. Under CUDA graphs a signature's second call is its capture, where nothing can be timed, so there
// the plan is made at the first call, the warm-up, for the step's first kPlansAtWarmUp problems (sizes that
// never repeat then cost a bounded amount of timing, not some on every call). Until a problem has its plan,
// past kMaxProblems, and where cuBLASLt cannot take the operands, ATen's op runs.
class PerSizeGemm final : public FastPath {
 public:
  static constexpr size_t kMaxProblems = 64;
  static constexpr size_t kPlansAtWarmUp = 8;

  PerSizeGemm(LtGemm::Shape shape, uint32_t a, uint32_t b, int32_t bias, int32_t out, Tuning tuning)
      : s_(shape), a_(a), b_(b), bias_(bias), out_(out), tuning_(std::move(tuning)) {}

  bool run(std::vector<c10::IValue>& buffers) const override {
    const at::Tensor* a = buffer_tensor(buffers, a_);
    const at::Tensor* b = buffer_tensor(buffers, b_);
    if (!a || !b || a->dim() != 2 || b->dim() != 2) return false;
    const Key key = {a->size(0), a->size(1), b->size(1), a->stride(0), a->stride(1), b->stride(0), b->stride(1)};
    std::lock_guard<std::mutex> lock(mutex_);
    Problem* p = last_ < problems_.size() && problems_[last_].key == key ? &problems_[last_] : nullptr;
    for (size_t i = 0; !p && i < problems_.size(); ++i)
      if (problems_[i].key == key) p = &problems_[last_ = i];
    if (!p) {
      if (problems_.size() >= kMaxProblems) return false;
      problems_.push_back({key});
      p = &problems_[last_ = problems_.size() - 1];
    }
    if (!p->gemm) {
      if (p->unsupported || (++p->calls < 2 && !(warming_for_graphs() && made_ < kPlansAtWarmUp))) return false;
      LtGemm::Shape s = s_;
      s.m = key[0], s.k = key[1], s.n = key[2];
      s.a_strides[0] = key[3], s.a_strides[1] = key[4], s.b_strides[0] = key[5], s.b_strides[1] = key[6];
      p->gemm = concrete_gemm(s, a_, b_, bias_, out_, tuning_);
      p->unsupported = !p->gemm;
      if (!p->gemm) return false;
      ++made_;
    }
    return p->gemm->run(buffers);
  }

  // "cublasLt per size (3 problems: 8x1024x512, ...), 12 calls": the problems made, the calls they ran.
  std::string describe() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    std::string sizes;
    size_t made = 0;
    uint64_t calls = 0;
    for (const Problem& p : problems_) {
      if (!p.gemm) continue;
      calls += p.gemm->calls();
      if (made++ < 4) sizes += ", " + p.gemm->problem();
    }
    return "cublasLt per size (" + std::to_string(made) + " problems" + (sizes.empty() ? "" : ":" + sizes.substr(1)) +
           (made > 4 ? ", ..." : "") + "), " + std::to_string(calls) + " calls";
  }

  std::vector<std::string> tuning() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::string> out;
    for (const Problem& p : problems_)
      if (p.gemm)
        for (std::string& line : p.gemm->tuning()) out.push_back(std::move(line));
    return out;
  }

 private:
  using Key = std::array<int64_t, 7>;  // m, k, n, A's strides, B's strides
  struct Problem {
    Key key{};
    int calls = 0;
    bool unsupported = false;
    std::shared_ptr<LtGemm> gemm;
  };
  LtGemm::Shape s_;  // dtype, device and epilogue; the sizes and strides come per problem
  uint32_t a_, b_;
  int32_t bias_, out_;
  Tuning tuning_;
  mutable std::mutex mutex_;
  mutable std::vector<Problem> problems_;
  mutable size_t last_ = 0;
  mutable size_t made_ = 0;  // problems with an LtGemm
};

std::shared_ptr<const FastPath> make_gemm(const Node& n, const Step& step, const Tuning& tuning) {
  static const bool enabled = [] {  // EMBER_CUBLASLT=0: every GEMM stays an ATen call
    return !config_is("EMBER_CUBLASLT", "0");
  }();
  if (!enabled) return nullptr;
  Epilogue epilogue;
  size_t first_matrix;
  if (n.op == "aten::mm") {
    epilogue = Epilogue::None, first_matrix = 0;
  } else if (n.op == "aten::addmm" || n.op == "aten::_addmm_activation") {
    first_matrix = 1;
    if (step.stack.size() < 5 || !is_one(step.stack[3]) || !is_one(step.stack[4])) return nullptr;
    epilogue = Epilogue::Bias;
    if (n.op == "aten::_addmm_activation") {
      if (step.stack.size() < 6 || !step.stack[5].isBool()) return nullptr;
      epilogue = step.stack[5].toBool() ? Epilogue::GeluBias : Epilogue::ReluBias;
    }
  } else {
    return nullptr;
  }
  const size_t tensors = first_matrix + 2;
  if (!step.scalar_from_buffer.empty() || !step.lists.empty() || step.outputs.size() != 1 || step.outputs[0] < 0 ||
      n.args.size() < tensors || n.outputs.size() != 1 || !n.outputs[0]->type.is_tensor())
    return nullptr;
  for (size_t i = 0; i < tensors; ++i)
    if (!n.args[i].is_value() || !n.args[i].value->type.is_tensor() || !slot_buffer(step, static_cast<uint32_t>(i)))
      return nullptr;
  const TensorType& a = n.args[first_matrix].value->type.tensor;
  const TensorType& b = n.args[first_matrix + 1].value->type.tensor;
  const TensorType& out = n.outputs[0]->type.tensor;
  if (a.sizes.size() != 2 || b.sizes.size() != 2 || out.sizes.size() != 2 || !row_major(out)) return nullptr;
  const c10::ScalarType dtype = a.dtype;
  if (dtype != c10::kFloat && dtype != c10::kHalf && dtype != c10::kBFloat16) return nullptr;
  if (b.dtype != dtype || out.dtype != dtype || !a.device.is_cuda() || b.device != a.device || out.device != a.device)
    return nullptr;
  LtGemm::Shape s;
  s.dtype = dtype;
  s.device = a.device.has_index() ? a.device.index() : 0;
  s.epilogue = epilogue;
  int32_t bias = -1;
  if (epilogue != Epilogue::None) {
    const TensorType& t = n.args[0].value->type.tensor;
    if (t.sizes.size() != 1 || !(t.sizes[0] == b.sizes[1]) || t.dtype != dtype || t.device != a.device) return nullptr;
    bias = static_cast<int32_t>(*slot_buffer(step, 0));
  }
  const uint32_t a_buffer = *slot_buffer(step, static_cast<uint32_t>(first_matrix));
  const uint32_t b_buffer = *slot_buffer(step, static_cast<uint32_t>(first_matrix + 1));
  if (!static_matrix(a) || !static_matrix(b) || !static_matrix(out))  // sizes Dynamo made dynamic: per problem
    return std::make_shared<PerSizeGemm>(s, a_buffer, b_buffer, bias, step.outputs[0], tuning);
  s.m = a.sizes[0].value, s.k = a.sizes[1].value, s.n = b.sizes[1].value;
  if (b.sizes[0].value != s.k || out.sizes[0].value != s.m || out.sizes[1].value != s.n) return nullptr;
  s.a_strides[0] = a.strides[0].value, s.a_strides[1] = a.strides[1].value;
  s.b_strides[0] = b.strides[0].value, s.b_strides[1] = b.strides[1].value;
  return concrete_gemm(s, a_buffer, b_buffer, bias, step.outputs[0], tuning);
}

const bool registered = (register_fast_path(&make_gemm), true);

}  // namespace
}  // namespace ember::cuda
