// The CPU kernel for a fusion group: a vectorized block interpreter over its Program.
//
// Why an interpreter: TorchInductor compiles generated C++ with g++ and waits seconds per graph; ember's
// first call must not wait for a compiler. Interpreting a Program costs one switch per instruction per
// block of elements (a 2048-element tile, or one row for groups with a reduction), so the dispatch is
// amortized over thousands of vectorized operations: inner loops are AVX2 Vectorized<float> code
// compiled ahead of time, and the "compile" of a group is the Program lowering, well under a millisecond.
//
// Per tile, each register is either a pointer to n floats or one uniform value (constants, row values,
// broadcast inputs), so broadcasts cost nothing and an instruction on uniform operands runs once.
// Contiguous float32 inputs are read in place; other dtypes, strides and broadcasts are gathered.
// Tiles run in parallel with at::parallel_for; under max-autotune each call shape's thread count is timed
// (thread_tuning.h).
#include "backend/package/xxhash.h"
#include "kernels/cpu/cpu_kernel.h"
#include "kernels/cpu/thread_tuning.h"
#include "kernels/iteration_space.h"

#include "ember/error.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>

// Built once per instruction set (CMake compiles this file for AVX2 and for AVX-512, with EMBER_CPU_ISA
// naming the namespace); kernels/cpu/dispatch.cpp picks the widest the CPU runs.
namespace ember::cpu::EMBER_CPU_ISA {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kTile = 512;  // floats per register per tile: a few live registers stay in L1
constexpr int64_t kMaxRank = 12;
constexpr int64_t kMaxBlockColumns = 4096;  // column groups up to this many columns run in blocks of rows

// n rounded up to whole vectors: the room every scratch slot has (see map_n).
constexpr int64_t padded(int64_t n) { return (n + Vec::size() - 1) / Vec::size() * Vec::size(); }

struct Reg {
  const float* p = nullptr;  // n values, or null: uniform value s
  float s = 0.f;
  // Nonzero: p is scratch with room for whole vectors, so a tail may load one (see map_n). 32 bits, not a
  // bool: with a bool, GCC copied a Reg's last 8 bytes through an unaligned load straddling the two stores
  // that had just written them, a store-forwarding stall on every instruction (softmax(x * 2) over 1000 x 96
  // floats: 126 -> 215 us).
  uint32_t scratch = 0;
};

C10_ALWAYS_INLINE Vec load(const Reg& r, int64_t i) { return r.p ? Vec::loadu(r.p + i) : Vec(r.s); }
// The last count < Vec::size() values: a masked load of an input read in place (the vector may run past
// its memory), a whole one of scratch, which forwards from the whole store that wrote it.
C10_ALWAYS_INLINE Vec load(const Reg& r, int64_t i, int64_t count) {
  return !r.p ? Vec(r.s) : r.scratch ? Vec::loadu(r.p + i) : Vec::loadu(r.p + i, count);
}

Vec round_lanes_half(const Vec& a) {
  float v[Vec::size()];
  a.store(v);
  for (float& x : v) x = static_cast<float>(static_cast<c10::Half>(x));
  return Vec::loadu(v);
}

Vec round_lanes_bfloat16(const Vec& a) {
  float v[Vec::size()];
  a.store(v);
  for (float& x : v) x = static_cast<float>(static_cast<c10::BFloat16>(x));
  return Vec::loadu(v);
}

// tanh from exp: (e - 1) / (e + 1) with e = exp(2x), x clamped to +-9 (tanh(9) rounds to 1), and an
// odd polynomial below |x| < 0.0625 where the quotient would cancel. Sleef's tanh is 3x slower.
Vec fast_tanh(const Vec& x) {
  Vec c = at::vec::clamp(x, Vec(-9.f), Vec(9.f));
  Vec e = (c + c).exp();
  Vec big = (e - Vec(1.f)) / (e + Vec(1.f));
  Vec x2 = x * x;
  Vec small = x * (Vec(1.f) + x2 * (Vec(-1.f / 3.f) + x2 * Vec(2.f / 15.f)));
  return Vec::blendv(big, small, x.abs() < Vec(0.0625f));
}

// ATen's exp_u20 (a degree-5 polynomial, within 20 ulp; ATen's softmax uses it) with NaN kept NaN, which
// the polynomial turns into inf. About 1.3x faster than Sleef's exp for sin(x).cos().exp() on 1M floats;
// results below FLT_MIN flush to 0 where eager gives denormals.
Vec fast_exp(const Vec& x) { return Vec::blendv(x.exp_u20(), x, x != x); }

// ATen's Vectorized erf is 1 - t * poly(t) * exp(-x^2), within ~1e-7 of erf but not of its size: near 0 the
// difference cancels (erf(1e-5) 2% low, erf(1e-10) 0, where eager's gives 1.13e-10; fuzz seed 64819, whose
// sqrt(|erf(x)|) then had an infinite gradient). Below 0.25 its Taylor series to x^9 instead (the next term
// is under 2e-10 of erf there).
Vec erf_small_exact(const Vec& x) {
  const float c = float(M_2_SQRTPI);
  Vec x2 = x * x;
  Vec series = x * (Vec(c) + x2 * (Vec(-c / 3.f) + x2 * (Vec(c / 10.f) + x2 * (Vec(-c / 42.f) + x2 * Vec(c / 216.f)))));
  return Vec::blendv(x.erf(), series, x.abs() < Vec(0.25f));
}

Vec gelu_erf(const Vec& x) { return x * Vec(0.5f) * (Vec(1.f) + (x * Vec(float(M_SQRT1_2))).erf()); }

Vec gelu_tanh(const Vec& x) {
  const Vec k(float(M_2_SQRTPI * M_SQRT1_2));
  return x * Vec(0.5f) * (Vec(1.f) + fast_tanh(k * (x + Vec(0.044715f) * x * x * x)));
}

// d/dx gelu(x) * grad: cdf(x) + x * pdf(x)
Vec gelu_backward(const Vec& grad, const Vec& x) {
  Vec cdf = Vec(0.5f) * (Vec(1.f) + (x * Vec(float(M_SQRT1_2))).erf());
  Vec pdf = (x * x * Vec(-0.5f)).exp() * Vec(float(0.5 * M_2_SQRTPI * M_SQRT1_2));
  return grad * (cdf + x * pdf);
}

// Every elementwise opcode once, as an expression over Vec a, b, c. Relu is ATen's clamp_min(x, 0), which keeps
// -0.0 (and NaN) where maximum(x, 0) gives +0.0.
#define EMBER_ELEMENTWISE_OPS(X)                                 \
  X(Copy, a)                                                     \
  X(Neg, a.neg())                                                \
  X(Exp, fast_exp(a))                                            \
  X(Log, a.log())                                                \
  X(Log1p, a.log1p())                                            \
  X(Expm1, a.expm1())                                            \
  X(Sin, a.sin())                                                \
  X(Cos, a.cos())                                                \
  X(Tanh, fast_tanh(a))                                          \
  X(Sigmoid, Vec(1.f) / (Vec(1.f) + a.neg().exp()))              \
  X(Relu, at::vec::clamp_min(a, Vec(0.f)))                       \
  X(Sqrt, a.sqrt())                                              \
  X(Rsqrt, a.rsqrt())                                            \
  X(Abs, a.abs())                                                \
  X(Reciprocal, a.reciprocal())                                  \
  X(Erf, erf_small_exact(a))                                     \
  X(RoundHalf, round_lanes_half(a))                              \
  X(RoundBFloat16, round_lanes_bfloat16(a))                      \
  X(ToBool, a.ne(Vec(0.f)))                                      \
  X(Gelu, gelu_erf(a))                                           \
  X(GeluTanh, gelu_tanh(a))                                      \
  X(Silu, a / (Vec(1.f) + a.neg().exp()))                        \
  X(GeluBackward, gelu_backward(a, b))                           \
  X(MulAdd, at::vec::fmadd(a, b, c))                             \
  X(Add, a + b)                                                  \
  X(Sub, a - b)                                                  \
  X(Mul, a * b)                                                  \
  X(Div, a / b)                                                  \
  X(Max, at::vec::maximum(a, b))                                 \
  X(Min, at::vec::minimum(a, b))                                 \
  X(Pow, a.pow(b))                                               \
  X(Gt, a.gt(b))                                                 \
  X(Lt, a.lt(b))                                                 \
  X(Ge, a.ge(b))                                                 \
  X(Le, a.le(b))                                                 \
  X(Eq, a.eq(b))                                                 \
  X(Ne, a.ne(b))                                                 \
  X(Where, Vec::blendv(c, b, a != Vec(0.f)))

// The loop for one instruction: the op is a template argument, so it is inlined into the loop. The
// operands are copied first: a vector store may alias anything, so through references every iteration
// reloaded the operands' pointers after its store (2-core AVX-512 host, one thread: a LayerNorm + mul
// row group over 64 x 768 took 39 us this way, 29 us with the copies; ATen's layer_norm 17 us).
//
// `out` is always scratch with room for n rounded up to whole vectors (kernel tiles and accumulators are
// sized so), so the tail stores a whole vector, and the next instruction loads it whole (Reg::scratch):
// that load forwards from the store, where a masked store followed by a masked load stalled. 2-core
// AVX-512 host, one thread, softmax(x * 2), fastest of 6 runs: 1000 x 100 floats 159 -> 144 us, 333 x 45
// 47 -> 34 us; 1000 x 96 (no tail) 121 us both.
// With `masked_tail` (one row of a block of rows, whose next row follows at out + n) the tail is stored
// masked instead.
template <class F>
void map_n(const F& f, const Reg& ra, const Reg& rb, const Reg& rc, float* out, int64_t n, bool masked_tail) {
  const Reg a = ra, b = rb, c = rc;
  constexpr int64_t w = Vec::size();
  int64_t i = 0;
  for (; i + w <= n; i += w) f(load(a, i), load(b, i), load(c, i)).store(out + i);
  if (i < n) {
    Vec tail = f(load(a, i, n - i), load(b, i, n - i), load(c, i, n - i));
    if (masked_tail) tail.store(out + i, n - i);
    else tail.store(out + i);
  }
}

void apply_n(OpCode op, const Reg& ra, const Reg& rb, const Reg& rc, float* out, int64_t n) {
  switch (op) {
#define EMBER_CASE(OP, EXPR)                                                                    \
  case OpCode::OP:                                                                              \
    map_n([](const Vec& a, const Vec& b, const Vec& c) -> Vec { return EXPR; }, ra, rb, rc, out, n, false); \
    return;
    EMBER_ELEMENTWISE_OPS(EMBER_CASE)
#undef EMBER_CASE
    default: break;
  }
  throw Error("internal: row op in apply_n()");
}

// One elementwise instruction over `rows` rows of `cols` values, for blocks of rows (run_row_blocks): an
// operand marked in `row_operand` holds one value per row (uniform over its row), any other is a full
// operand (rows * cols values) or a single value. Tails are stored masked: the next row follows.
template <class F>
void map_rows(const F& f, const Reg (&in)[3], const bool (&row_operand)[3], float* out, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    Reg x[3];
    for (int k = 0; k < 3; ++k)
      x[k] = row_operand[k] ? Reg{nullptr, in[k].p[r]} : in[k].p ? Reg{in[k].p + r * cols} : in[k];
    map_n(f, x[0], x[1], x[2], out + r * cols, cols, true);
  }
}

void apply_rows(OpCode op, const Reg (&in)[3], const bool (&row_operand)[3], float* out, int64_t rows, int64_t cols) {
  switch (op) {
#define EMBER_CASE(OP, EXPR)                                                                                  \
  case OpCode::OP:                                                                                            \
    map_rows([](const Vec& a, const Vec& b, const Vec& c) -> Vec { return EXPR; }, in, row_operand, out, rows, cols); \
    return;
    EMBER_ELEMENTWISE_OPS(EMBER_CASE)
#undef EMBER_CASE
    default: break;
  }
  throw Error("internal: row op in apply_rows()");
}

// into[0, n) = op(into, x) for a reduction's op, storing nothing past n: a block accumulator's later rows
// hold earlier blocks' values where a short block ends (run_columns).
void accumulate(OpCode op, float* into, const Reg& x, int64_t n) {
  const Reg a{into, 0.f}, none{};
  auto max = [](const Vec& p, const Vec& q, const Vec&) { return at::vec::maximum(p, q); };
  auto min = [](const Vec& p, const Vec& q, const Vec&) { return at::vec::minimum(p, q); };
  auto add = [](const Vec& p, const Vec& q, const Vec&) { return p + q; };
  if (op == OpCode::RowMax) map_n(max, a, x, none, into, n, true);
  else if (op == OpCode::RowMin) map_n(min, a, x, none, into, n, true);
  else map_n(add, a, x, none, into, n, true);
}

float apply_scalar(OpCode op, float a, float b, float c) {
  float out[Vec::size()];
  Reg ra{nullptr, a}, rb{nullptr, b}, rc{nullptr, c};
  apply_n(op, ra, rb, rc, out, 1);
  return out[0];
}

// `n` values folded with `f` (identity `identity`) in four independent vector accumulators: with one
// (ATen's reduce_all) every step waits for the previous one (the LayerNorm group above: 29 -> 26 us; a
// mul + row sum over 64 x 768, 6.7 -> 5.3 us).
template <class F>
float reduce_lanes(const float* p, int64_t n, float identity, const F& f, uint32_t scratch) {
  constexpr int64_t w = Vec::size();
  Vec a0(identity), a1(identity), a2(identity), a3(identity);
  int64_t i = 0;
  for (; i + 4 * w <= n; i += 4 * w) {
    a0 = f(a0, Vec::loadu(p + i));
    a1 = f(a1, Vec::loadu(p + i + w));
    a2 = f(a2, Vec::loadu(p + i + 2 * w));
    a3 = f(a3, Vec::loadu(p + i + 3 * w));
  }
  for (; i + w <= n; i += w) a0 = f(a0, Vec::loadu(p + i));
  if (i < n) a1 = f(a1, Vec::set(Vec(identity), scratch ? Vec::loadu(p + i) : Vec::loadu(p + i, n - i), n - i));
  return at::vec::vec_reduce_all<float>(f, f(f(a0, a1), f(a2, a3)));
}

float reduce(OpCode op, const Reg& r, int64_t n) {
  if (!r.p) {  // one value r.s in every column; over no column the reduction's identity, whatever r.s is
    if (op == OpCode::RowSum) return n ? r.s * static_cast<float>(n) : 0.f;
    if (op == OpCode::RowMean) return n ? r.s : std::numeric_limits<float>::quiet_NaN();
    return n ? r.s : (op == OpCode::RowMax ? -INFINITY : INFINITY);
  }
  if (op == OpCode::RowSum || op == OpCode::RowMean) {
    float s = reduce_lanes(r.p, n, 0.f, [](const Vec& x, const Vec& y) { return x + y; }, r.scratch);
    return op == OpCode::RowSum ? s : s / static_cast<float>(n);
  }
  if (n == 0) return op == OpCode::RowMax ? -INFINITY : INFINITY;
  // maximum/minimum propagate NaN, as amax/amin do.
  auto max = [](const Vec& x, const Vec& y) { return at::vec::maximum(x, y); };
  auto min = [](const Vec& x, const Vec& y) { return at::vec::minimum(x, y); };
  return op == OpCode::RowMax ? reduce_lanes(r.p, n, -INFINITY, max, r.scratch) : reduce_lanes(r.p, n, INFINITY, min, r.scratch);
}

// One strided tensor operand seen through the iteration space: strides aligned to it (0 = broadcast).
struct View {
  const char* data = nullptr;
  c10::ScalarType dtype = c10::kFloat;
  int64_t strides[kMaxRank] = {};  // in elements, aligned to the full shape (or the row shape)
  bool dense = false;              // contiguous over the whole full shape
};

// Calls f(T{}) with the C++ type of an input dtype, so that loops converting many values switch once.
template <class F>
void with_input_type(c10::ScalarType dtype, const F& f) {
  switch (dtype) {
    case c10::kFloat: return f(float{});
    case c10::kHalf: return f(c10::Half{});
    case c10::kBFloat16: return f(c10::BFloat16{});
    case c10::kBool: return f(bool{});
    case c10::kDouble: return f(double{});
    case c10::kLong: return f(int64_t{});
    case c10::kInt: return f(int32_t{});
    case c10::kByte: return f(uint8_t{});
    case c10::kChar: return f(int8_t{});
    case c10::kShort: return f(int16_t{});
    default: break;
  }
  throw Error(std::string("fused CPU kernel: unsupported input dtype ") + c10::toString(dtype));
}

float load_one(const View& v, int64_t offset) {
  float value = 0.f;
  with_input_type(v.dtype, [&](auto type) { value = static_cast<float>(reinterpret_cast<const decltype(type)*>(v.data)[offset]); });
  return value;
}

// n values of `v` from `offset` on, `stride` apart, as floats into `out`: the dtype switch once per run, not
// once per value (a causal mask's bool [L, L] read value by value through load_one took a quarter of the
// 2-core host's time in a dense flex attention).
void load_run(const View& v, int64_t offset, int64_t stride, int64_t n, float* out) {
  with_input_type(v.dtype, [&](auto type) {
    const auto* p = reinterpret_cast<const decltype(type)*>(v.data) + offset;
    if (stride == 1)
      for (int64_t k = 0; k < n; ++k) out[k] = static_cast<float>(p[k]);
    else
      for (int64_t k = 0; k < n; ++k) out[k] = static_cast<float>(p[k * stride]);
  });
}

void store_n(const float* src, const Reg& r, int64_t n, c10::ScalarType dtype, char* out) {
  auto value = [&](int64_t i) { return src ? src[i] : r.s; };
  switch (dtype) {
    case c10::kFloat:
      if (src) std::memcpy(out, src, n * sizeof(float));
      else std::fill_n(reinterpret_cast<float*>(out), n, r.s);
      return;
    case c10::kHalf:
      for (int64_t i = 0; i < n; ++i) reinterpret_cast<c10::Half*>(out)[i] = static_cast<c10::Half>(value(i));
      return;
    case c10::kBFloat16:
      for (int64_t i = 0; i < n; ++i) reinterpret_cast<c10::BFloat16*>(out)[i] = static_cast<c10::BFloat16>(value(i));
      return;
    case c10::kBool:
      for (int64_t i = 0; i < n; ++i) reinterpret_cast<bool*>(out)[i] = value(i) != 0.f;
      return;
    default: break;
  }
  throw Error(std::string("fused CPU kernel: unsupported output dtype ") + c10::toString(dtype));
}

// How many threads a call's loops take: at most `limit` (0: as many as ATen's parallel_for gives them, the
// default), and, for the tuner, the most any of its loops could take (thread_tuning.h, point 2).
struct ThreadCap {
  int64_t limit = 0;
  int64_t took = 1;
  // The grain of a loop over `range` items whose own grain is `grain`: with ATen's OpenMP backend a loop takes
  // min(threads, ceil(range / grain)) threads, so a grain of at least ceil(range / limit) takes at most `limit`.
  int64_t grain(int64_t range, int64_t grain) {
    if (limit > 0) grain = std::max(grain, (range + limit - 1) / limit);
    took = std::max(took, (range + grain - 1) / grain);
    return grain;
  }
  // The threads a loop that splits its work by the thread count plans for (run_columns).
  int64_t available() const {
    const int64_t n = at::get_num_threads();
    return limit > 0 ? std::min(limit, n) : n;
  }
};

// Which of the kernel's loops runs a call (ThreadShape::path).
enum Path : int64_t { kNothing, kFlat, kRows, kRowBlocks, kColumns };

class FusedCpuKernel final : public Kernel {
 public:
  FusedCpuKernel(Program program, const Tuning& tuning)
      : p_(std::move(program)), tuner_(tuning.exhaustive ? std::make_unique<ThreadTuner>(tuning, identity(p_)) : nullptr) {
    for (const ProgramOutput& o : p_.outputs) out_dtypes_.push_back(o.value->type.tensor.dtype);
    assign_slots();
    // A pointwise group whose outputs are dense in another order than row-major (channels_last; passes/fuse.cpp
    // keeps one order per group) iterates in that order, outermost in memory first, and lays its outputs out so,
    // as eager does. The order is the traced strides', largest first, which places size-1 dims where eager's
    // layout has them (channels_last's H of 1 keeps the stride W * C); with a symbolic stride, size-1 dims lead.
    if (!p_.has_reduction && !p_.outputs.empty()) {
      const TensorType& t = p_.outputs[0].value->type.tensor;
      const std::vector<int> order = memory_order(t);
      if (!order.empty() && !std::is_sorted(order.begin(), order.end())) {
        const bool constant = std::all_of(t.strides.begin(), t.strides.end(), [](const Dim& d) { return d.is_constant(); });
        for (int d = 0; d < static_cast<int>(t.sizes.size()); ++d)
          if (constant || std::find(order.begin(), order.end(), d) == order.end()) order_.push_back(d);
        if (constant)
          std::stable_sort(order_.begin(), order_.end(), [&](int a, int b) { return t.strides[a].value > t.strides[b].value; });
        else
          order_.insert(order_.end(), order.begin(), order.end());
      }
    }
  }

  std::string describe() const override {
    return std::string("cpu fused group (" EMBER_CPU_ISA_NAME ") ") + std::to_string(p_.group) + " (" + std::to_string(p_.code.size()) + " instructions" +
           (!p_.has_reduction ? "" : p_.outer ? ", column reductions" : ", row reductions") + ")";
  }

  void run(std::vector<c10::IValue>& buffers, const std::vector<uint32_t>& reads,
           const std::vector<uint32_t>& writes) const override {
    const size_t n_in = p_.inputs.size();
    const IterationSpace space = iteration_space(p_, buffers, reads);
    const std::vector<int64_t>& full = space.full;
    const std::vector<int64_t>& row_shape = space.row_shape;
    const int64_t numel = space.numel, rows = space.rows, cols = space.cols;
    if (full.size() > static_cast<size_t>(kMaxRank)) throw Error("fused CPU kernel: rank above 12");

    std::vector<View> views(n_in);
    for (size_t i = 0; i < n_in; ++i)
      views[i] = make_view(buffers[reads[i]].toTensor(), p_.inputs[i].row ? row_shape : full, numel, p_.outer > 0);
    std::vector<float> scalars(p_.scalars.size());
    for (size_t s = 0; s < scalars.size(); ++s) {
      const c10::IValue& v = buffers[reads[n_in + s]];
      scalars[s] = v.isDouble() ? static_cast<float>(v.toDouble()) : v.isBool() ? float(v.toBool()) : float(v.toInt());
    }
    std::vector<at::Tensor> outs;
    outs.reserve(p_.outputs.size());
    std::vector<int64_t> permuted;  // a flat group's iteration space in order_ (permute)
    if (order_.size() == full.size() && !full.empty()) {
      permuted = permute(views, outs, full);
    } else {
      for (size_t o = 0; o < p_.outputs.size(); ++o)
        outs.push_back(at::empty(output_shape(p_.outputs[o], full, p_.has_reduction, p_.outer), at::TensorOptions().dtype(out_dtypes_[o])));
    }
    const Path path = path_of(views, full, numel, rows, cols);
    const std::vector<int64_t>& shape = permuted.empty() ? full : permuted;
    ThreadCap cap;
    if (tuner_) cap.limit = tuned_limit(path, views, scalars, outs, shape, space);
    run_path(path, views, scalars, outs, shape, space, cap);
    for (size_t o = 0; o < outs.size(); ++o) buffers[writes[o]] = std::move(outs[o]);
  }

  // The thread tuner's name for this kernel in disk records: the instruction set and the program's text.
  static std::string identity(const Program& p) {
    const std::string text = p.text();
    char hash[20];
    std::snprintf(hash, sizeof hash, "%016llx", static_cast<unsigned long long>(
                      xxh64(reinterpret_cast<const uint8_t*>(text.data()), text.size(), 0)));
    return std::string(EMBER_CPU_ISA_NAME " ") + hash + " " + std::to_string(text.size());
  }

  std::vector<std::string> tuning() const override {
    std::vector<std::string> out = tuner_ ? tuner_->lines() : std::vector<std::string>();
    for (std::string& line : out) line = "cpu fused group " + std::to_string(p_.group) + " " + line;
    return out;
  }

 private:
  // The loop a call takes: short rows run in blocks where every full input is dense or one value (blockable).
  Path path_of(const std::vector<View>& views, const std::vector<int64_t>& full, int64_t numel, int64_t rows,
               int64_t cols) const {
    if (p_.outer > 0) return rows > 0 ? kColumns : kNothing;
    if (!p_.has_reduction) return numel > 0 ? kFlat : kNothing;
    if (numel == 0 && rows == 0) return kNothing;
    return cols >= 2 && cols < kShortRow && rows > 1 && blockable(views, full) ? kRowBlocks : kRows;
  }

  // Runs the call's loop `path` over `full` (a flat group's permuted space), as many threads as `cap` lets.
  void run_path(Path path, std::vector<View>& views, const std::vector<float>& scalars, std::vector<at::Tensor>& outs,
                const std::vector<int64_t>& full, const IterationSpace& space, ThreadCap& cap) const {
    switch (path) {
      case kFlat: return run_flat(views, scalars, outs, full, space.numel, cap);
      case kRows: return run_rows(views, scalars, outs, full, space.rows, space.cols, cap);
      case kRowBlocks: return run_row_blocks(views, scalars, outs, full, space.rows, space.cols, cap);
      case kColumns: return run_columns(views, scalars, outs, full, space.row_shape, space.cols, space.rows, cap);
      case kNothing: return;
    }
  }

  // Under max-autotune: the thread limit chosen for the call's shape, chosen at its first call by timing the call
  // on its own buffers (each trial writes `outs`; the caller's run, with the winner, comes last). 0: the default.
  int64_t tuned_limit(Path path, const std::vector<View>& views, const std::vector<float>& scalars,
                      std::vector<at::Tensor>& outs, const std::vector<int64_t>& full,
                      const IterationSpace& space) const {
    const ThreadShape shape{space.numel, space.rows, space.cols, path, at::get_num_threads()};
    int64_t limit = tuner_->find(shape);
    if (limit == ThreadTuner::kUnchosen && path != kNothing && !tuner_->full()) {
      auto by = [](int64_t a, int64_t b) { return std::to_string(a) + "x" + std::to_string(b); };
      const std::string what = path == kFlat      ? std::to_string(space.numel) + " elements"
                               : path == kColumns ? by(space.cols, space.rows) + " columns"
                               : path == kRows    ? by(space.rows, space.cols) + " rows"
                                                  : by(space.rows, space.cols) + " rows in blocks";
      limit = tuner_->choose(shape, what, [&](int64_t trial_limit) {
        std::vector<View> trial = views;  // run_flat coalesces the views it is given
        ThreadCap cap{trial_limit};
        run_path(path, trial, scalars, outs, full, space, cap);
        return cap.took;
      });
    }
    return std::max<int64_t>(limit, 0);
  }

  // A flat group in order_ (see the constructor): the outputs laid out so that their memory order is row-major in
  // the permuted iteration space returned, and every input's strides permuted to it; an input in the outputs'
  // layout is dense there.
  std::vector<int64_t> permute(std::vector<View>& views, std::vector<at::Tensor>& outs,
                               const std::vector<int64_t>& full) const {
    const size_t rank = full.size();
    std::vector<int64_t> shape(rank), strides(rank);
    for (size_t i = 0; i < rank; ++i) shape[i] = full[static_cast<size_t>(order_[i])];
    int64_t step = 1;
    for (size_t i = rank; i-- > 0;) {
      strides[static_cast<size_t>(order_[i])] = step;
      step *= shape[i];
    }
    for (size_t o = 0; o < p_.outputs.size(); ++o)
      outs.push_back(at::empty_strided(full, strides, at::TensorOptions().dtype(out_dtypes_[o])));
    for (View& v : views) {
      int64_t permuted[kMaxRank];
      for (size_t i = 0; i < rank; ++i) permuted[i] = v.strides[order_[i]];
      std::copy(permuted, permuted + rank, v.strides);
      bool dense = true;
      for (size_t i = rank, expect = 1; i-- > 0 && dense;) {
        dense = shape[i] == 1 || v.strides[i] == static_cast<int64_t>(expect);
        expect *= static_cast<size_t>(shape[i]);
      }
      v.dense = dense;
    }
    return shape;
  }

  // Aligns `t` to `space` (trailing dimensions; a keepdim [..., 1] row input drops its last dim).
  static View make_view(const at::Tensor& t, const std::vector<int64_t>& space, int64_t full_numel, bool trailing) {
    View v;
    v.data = static_cast<const char*>(t.data_ptr());
    v.dtype = t.scalar_type();
    aligned_strides(t, space, v.strides, trailing);
    v.dense = t.is_contiguous() && t.numel() == full_numel && t.dim() >= 0 && static_cast<int64_t>(space.size()) == t.dim();
    return v;
  }

  struct Scratch {
    std::vector<float> data;
    std::vector<Reg> regs;
  };
  Scratch& scratch(int64_t tile) const {
    thread_local Scratch s;
    size_t need = static_cast<size_t>(num_slots_) * tile;
    if (s.data.size() < need) s.data.resize(need);
    s.regs.assign(p_.reg_is_row.size(), Reg{});
    return s;
  }

  // Loads input i for positions [start, start + n) of `space`, given the offset of `start`.
  static void load_input(const View& v, Reg& r, float* buf, int64_t n, int64_t base, int64_t inner_stride) {
    if (inner_stride == 0) {
      r = Reg{nullptr, load_one(v, base)};
      return;
    }
    if (v.dtype == c10::kFloat && inner_stride == 1) {
      r = Reg{reinterpret_cast<const float*>(v.data) + base};
      return;
    }
    load_run(v, base, inner_stride, n, buf);
    r = Reg{buf, 0.f, 1};
  }

  // n values from `base` with a fixed stride (0: one value repeated) into `out`.
  static void load_row(const View& v, float* out, int64_t n, int64_t base, int64_t stride) {
    if (stride == 0) std::fill(out, out + n, load_one(v, base));
    else load_run(v, base, stride, n, out);
  }

  // The offset, through `strides`, of position `index` of the first `dims` dimensions of `shape` (row-major).
  static int64_t leading_offset(int64_t index, const std::vector<int64_t>& shape, int64_t dims, const int64_t* strides) {
    int64_t offset = 0;
    for (int64_t d = dims - 1; d >= 0; --d) {
      offset += (index % shape[d]) * strides[d];
      index /= shape[d];
    }
    return offset;
  }

  // General strided gather over a flat range of `shape` (strides[d] for its dim d), from offset `base`.
  static void gather(const View& v, const std::vector<int64_t>& shape, int64_t start, int64_t n, float* buf,
                     const int64_t* strides = nullptr, int64_t base = 0) {
    if (!strides) strides = v.strides;
    int64_t rank = static_cast<int64_t>(shape.size());
    int64_t idx[kMaxRank];
    int64_t rest = start, off = base;
    for (int64_t d = rank - 1; d >= 0; --d) {
      idx[d] = rest % shape[d];
      rest /= shape[d];
      off += idx[d] * strides[d];
    }
    with_input_type(v.dtype, [&](auto type) {
      const auto* p = reinterpret_cast<const decltype(type)*>(v.data);
      for (int64_t k = 0; k < n; ++k) {
        buf[k] = static_cast<float>(p[off]);
        for (int64_t d = rank - 1; d >= 0; --d) {
          off += strides[d];
          if (++idx[d] < shape[d]) break;
          off -= idx[d] * strides[d];
          idx[d] = 0;
        }
      }
    });
  }

  // One elementwise instruction over n values: once where every operand is uniform, else into the scratch
  // slot of its destination.
  Reg elementwise(const Instr& ins, const Reg& a, const Reg& b, const Reg& c, float* data, int64_t tile, int64_t n) const {
    if (!a.p && !b.p && !c.p) return Reg{nullptr, apply_scalar(ins.op, a.s, b.s, c.s)};
    float* out = data + static_cast<int64_t>(slot_[ins.dst]) * tile;
    apply_n(ins.op, a, b, c, out, n);
    return Reg{out, 0.f, 1};
  }

  static Reg operand_of(const Operand& o, const std::vector<Reg>& regs, const std::vector<float>& scalars) {
    switch (o.kind) {
      case Operand::Kind::Reg: return regs[o.index];
      case Operand::Kind::Imm: return Reg{nullptr, o.imm};
      case Operand::Kind::Scalar: return Reg{nullptr, scalars[o.index]};
      case Operand::Kind::None: break;
    }
    return Reg{};
  }

  void execute(std::vector<Reg>& regs, float* data, int64_t tile, int64_t n, const std::vector<float>& scalars) const {
    auto operand = [&](const Operand& o) { return operand_of(o, regs, scalars); };
    for (const Instr& ins : p_.code) {
      Reg a = operand(ins.a), b = operand(ins.b), c = operand(ins.c);
      Reg& d = regs[ins.dst];
      if (ins.op >= OpCode::RowSum) {
        d = Reg{nullptr, reduce(ins.op, a, n)};
        continue;
      }
      d = elementwise(ins, a, b, c, data, tile, n);
    }
  }

  // Merges adjacent dimensions of `shape` that every view steps through alike (the outer one's stride is the
  // inner one's times its size; dimensions of size 1 drop out), as TensorIterator does: the elements keep
  // their row-major order, so flat positions and the outputs are unchanged. A broadcast over leading
  // dimensions then reads as rows of a fixed stride: where(mask[3, 1, 1, 1, 1], g.expand(3, 64, 3, 49, 32), 0)
  // has rows of 32 values, gathered one value at a time, but merges to [3, 301056] (2-core host: 8.0 ms
  // against eager's 0.65 before).
  static std::vector<int64_t> coalesce(const std::vector<int64_t>& shape, std::vector<View>& views) {
    // Kept dimensions are written innermost first from the end of each view's strides (slot rank - 1 - k for
    // the k-th kept, never below the dimension being read), then moved to the front.
    const int64_t rank = static_cast<int64_t>(shape.size());
    int64_t sizes[kMaxRank];
    int64_t kept = 0;
    for (int64_t d = rank - 1; d >= 0; --d) {
      if (shape[d] == 1 && !(kept == 0 && d == 0)) continue;
      bool joins = kept > 0;
      for (size_t i = 0; joins && i < views.size(); ++i)
        joins = views[i].strides[d] == views[i].strides[rank - kept] * sizes[kept - 1];
      if (joins) {
        sizes[kept - 1] *= shape[d];
        continue;
      }
      for (View& v : views) v.strides[rank - 1 - kept] = v.strides[d];
      sizes[kept++] = shape[d];
    }
    if (kept == 0) {  // rank 0: one value
      for (View& v : views) v.strides[0] = 0;
      return {1};
    }
    std::vector<int64_t> merged(kept);
    for (int64_t k = 0; k < kept; ++k) merged[kept - 1 - k] = sizes[k];
    for (View& v : views) std::copy(v.strides + rank - kept, v.strides + rank, v.strides);
    return merged;
  }

  // Groups without reductions. When every input is dense or a single value, tiles are flat ranges of
  // kTile elements. Otherwise, if rows (after coalesce) are long enough, tiles are pieces of one row of the
  // last dimension, so each input is read in place, as one value, or with a fixed stride; short rows with
  // broadcasting fall back to a general gather.
  void run_flat(std::vector<View>& views, const std::vector<float>& scalars, std::vector<at::Tensor>& outs,
                const std::vector<int64_t>& full_shape, int64_t numel, ThreadCap& cap) const {
    const std::vector<int64_t> full = coalesce(full_shape, views);
    const int64_t rank = static_cast<int64_t>(full.size());
    std::vector<char> uniform(views.size());
    bool all_simple = true;
    for (size_t i = 0; i < views.size(); ++i) {
      uniform[i] = uniform_view(views[i], full);
      all_simple = all_simple && (uniform[i] || views[i].dense);
    }
    const int64_t cols = rank ? full.back() : 1;
    // Rows of 16 or more values: each input is read a row at a time, in place, as one value or with a fixed
    // stride. Rows shorter than a tile share one (whole rows, loaded one after another), so that the
    // instructions run over a full tile: where(mask, g.expand(...), 0) + x with x transposed in its last two
    // dimensions, rows of 32 (3 x 64 x 3 x 49 x 32 floats, 2-core host): 9-12 ms gathered value by value,
    // 1.3 ms so (eager 0.8).
    const bool by_rows = !all_simple && cols >= 16;
    const int64_t rows_total = by_rows ? numel / cols : 0;
    const int64_t rows_per_tile = by_rows ? std::max<int64_t>(1, kTile / cols) : 0;
    const int64_t chunks_per_row = by_rows ? (cols + kTile - 1) / kTile : 1;
    const int64_t tiles = !by_rows ? (numel + kTile - 1) / kTile
                          : rows_per_tile > 1 ? (rows_total + rows_per_tile - 1) / rows_per_tile
                                              : rows_total * chunks_per_row;
    at::parallel_for(0, tiles, cap.grain(tiles, std::max<int64_t>(1, 32768 / kTile)), [&](int64_t begin, int64_t end) {
      Scratch& s = scratch(kTile);
      int64_t first_row[kMaxRank];  // multi-index of a tile's first row over the leading dimensions
      for (int64_t t = begin; t < end; ++t) {
        int64_t start, n, row = 0, col = 0, nrows = 1;
        if (by_rows && rows_per_tile > 1) {
          row = t * rows_per_tile;
          nrows = std::min(rows_per_tile, rows_total - row);
          start = row * cols;
          n = nrows * cols;
        } else if (by_rows) {
          row = t / chunks_per_row;
          col = (t % chunks_per_row) * kTile;
          start = row * cols + col;
          n = std::min(kTile, cols - col);
        } else {
          start = t * kTile;
          n = std::min(kTile, numel - start);
        }
        if (by_rows)
          for (int64_t d = rank - 2, rest = row; d >= 0; --d) {
            first_row[d] = rest % full[d];
            rest /= full[d];
          }
        for (size_t i = 0; i < views.size(); ++i) {
          const View& v = views[i];
          Reg& r = s.regs[p_.inputs[i].reg];
          float* buf = s.data.data() + static_cast<int64_t>(slot_[p_.inputs[i].reg]) * kTile;
          if (uniform[i]) {
            load_input(v, r, buf, n, 0, 0);
          } else if (v.dense) {
            load_input(v, r, buf, n, start, 1);
          } else if (by_rows) {
            int64_t at[kMaxRank];
            std::copy(first_row, first_row + std::max<int64_t>(rank - 1, 0), at);
            for (int64_t rr = 0; rr < nrows; ++rr) {
              int64_t base = col * v.strides[rank - 1];
              for (int64_t d = 0; d + 1 < rank; ++d) base += at[d] * v.strides[d];
              if (nrows == 1) {
                load_input(v, r, buf, n, base, v.strides[rank - 1]);
                break;
              }
              load_row(v, buf + rr * cols, cols, base, v.strides[rank - 1]);
              for (int64_t d = rank - 2; d >= 0; --d) {
                if (++at[d] < full[d]) break;
                at[d] = 0;
              }
            }
            if (nrows > 1) r = Reg{buf, 0.f, 1};
          } else {
            gather(v, full, start, n, buf);
            r = Reg{buf, 0.f, 1};
          }
        }
        execute(s.regs, s.data.data(), kTile, n, scalars);
        for (size_t o = 0; o < outs.size(); ++o) {
          const Reg& r = s.regs[p_.outputs[o].reg];
          char* dst = static_cast<char*>(outs[o].data_ptr()) + start * outs[o].element_size();
          store_n(r.p, r, n, out_dtypes_[o], dst);
        }
      }
    });
  }

  // Groups with row reductions, a row at a time (short rows: run_row_blocks).
  void run_rows(const std::vector<View>& views, const std::vector<float>& scalars, std::vector<at::Tensor>& outs,
                const std::vector<int64_t>& full, int64_t rows, int64_t cols, ThreadCap& cap) const {
    const int64_t lead = static_cast<int64_t>(full.size()) - 1;
    const int64_t tile = padded(std::max<int64_t>(cols, 1));  // a slot's stride: whole vectors (map_n)
    at::parallel_for(0, rows, cap.grain(rows, std::max<int64_t>(1, 32768 / tile)), [&](int64_t begin, int64_t end) {
      Scratch& s = scratch(tile);
      for (int64_t row = begin; row < end; ++row) {
        for (size_t i = 0; i < views.size(); ++i) {
          const View& v = views[i];
          const int64_t base = leading_offset(row, full, lead, v.strides);
          Reg& r = s.regs[p_.inputs[i].reg];
          float* buf = s.data.data() + static_cast<int64_t>(slot_[p_.inputs[i].reg]) * tile;
          if (p_.inputs[i].row) load_input(v, r, buf, 1, base, 0);
          else load_input(v, r, buf, cols, base, cols == 1 ? 0 : v.strides[lead]);
        }
        execute(s.regs, s.data.data(), tile, cols, scalars);
        for (size_t o = 0; o < outs.size(); ++o) {
          const ProgramOutput& po = p_.outputs[o];
          const Reg& r = s.regs[po.reg];
          int64_t count = po.row ? 1 : cols;
          char* dst = static_cast<char*>(outs[o].data_ptr()) + row * count * outs[o].element_size();
          store_n(po.row ? nullptr : r.p, r, count, out_dtypes_[o], dst);
        }
      }
    });
  }

  // Short rows run in blocks of rows: decoding each instruction once per row cost more than its arithmetic.
  // A block is R whole rows: elementwise instructions run over all R * cols values at once, reductions row
  // by row into R-value row registers, and instructions mixing full and row registers row by row inside one
  // call (apply_rows; tails masked there: the next row's values follow). Every full input must be dense or a
  // single value, so that R rows of it are R * cols consecutive values.
  // 2-core AVX-512 host, 2 threads, 10th percentile of 1500 calls, fastest of three runs, row by row ->
  // blocks (eager):
  //   softmax(x * 2)  10000 x 10: 627 -> 174 us (958), 5000 x 20: 363 -> 109 (97), 1000 x 100: 100 -> 55 (54)
  //   entropy         10000 x 10: 689 -> 250 us (1977), 5000 x 20: 383 -> 161 (236-342)
  // Of that, apply_rows (one call per block instead of one per row) took softmax's 215 -> 174 and 128 -> 109.
  static constexpr int64_t kShortRow = 128;
  static constexpr int64_t kBlockValues = 2048;  // R * cols, about: a few live registers stay in L1

  static bool uniform_view(const View& v, const std::vector<int64_t>& shape) {
    for (size_t d = 0; d < shape.size(); ++d)
      if (v.strides[d] != 0 && shape[d] != 1) return false;
    return true;
  }

  bool blockable(const std::vector<View>& views, const std::vector<int64_t>& full) const {
    for (size_t i = 0; i < views.size(); ++i)
      if (!p_.inputs[i].row && !views[i].dense && !uniform_view(views[i], full)) return false;
    return true;
  }

  void run_row_blocks(const std::vector<View>& views, const std::vector<float>& scalars, std::vector<at::Tensor>& outs,
                      const std::vector<int64_t>& full, int64_t rows, int64_t cols, ThreadCap& cap) const {
    const int64_t lead = static_cast<int64_t>(full.size()) - 1;
    const int64_t per_block = std::max<int64_t>(1, kBlockValues / cols);
    const int64_t tile = padded(per_block * cols);
    const int64_t blocks = (rows + per_block - 1) / per_block;
    std::vector<char> uniform(views.size());
    for (size_t i = 0; i < views.size(); ++i) uniform[i] = !p_.inputs[i].row && uniform_view(views[i], full);
    at::parallel_for(0, blocks, cap.grain(blocks, std::max<int64_t>(1, 32768 / tile)), [&](int64_t begin, int64_t end) {
      Scratch& s = scratch(tile);
      for (int64_t block = begin; block < end; ++block) {
        const int64_t row0 = block * per_block, n_rows = std::min(per_block, rows - row0);
        for (size_t i = 0; i < views.size(); ++i) {
          const View& v = views[i];
          Reg& r = s.regs[p_.inputs[i].reg];
          float* buf = s.data.data() + static_cast<int64_t>(slot_[p_.inputs[i].reg]) * tile;
          if (uniform[i]) {
            load_input(v, r, buf, 1, 0, 0);
          } else if (!p_.inputs[i].row) {
            load_input(v, r, buf, n_rows * cols, row0 * cols, 1);  // dense: R rows in a run
          } else {
            for (int64_t k = 0; k < n_rows; ++k) buf[k] = load_one(v, leading_offset(row0 + k, full, lead, v.strides));
            r = Reg{buf, 0.f, 1};
          }
        }
        execute_block(s.regs, s.data.data(), tile, n_rows, cols, scalars);
        for (size_t o = 0; o < outs.size(); ++o) {
          const ProgramOutput& po = p_.outputs[o];
          const Reg& r = s.regs[po.reg];
          const int64_t count = po.row ? n_rows : n_rows * cols;
          char* dst = static_cast<char*>(outs[o].data_ptr()) + (po.row ? row0 : row0 * cols) * outs[o].element_size();
          store_n(r.p, r, count, out_dtypes_[o], dst);
        }
      }
    });
  }

  // One block's instructions (see run_row_blocks): full registers hold n_rows * cols values, row
  // registers n_rows (or one value each).
  void execute_block(std::vector<Reg>& regs, float* data, int64_t tile, int64_t n_rows, int64_t cols,
                     const std::vector<float>& scalars) const {
    auto operand = [&](const Operand& o) { return operand_of(o, regs, scalars); };
    auto row_values = [&](const Operand& o) {
      return o.kind == Operand::Kind::Reg && p_.reg_is_row[o.index] && regs[o.index].p != nullptr;
    };
    for (const Instr& ins : p_.code) {
      Reg a = operand(ins.a), b = operand(ins.b), c = operand(ins.c);
      Reg& d = regs[ins.dst];
      float* out = data + static_cast<int64_t>(slot_[ins.dst]) * tile;
      if (ins.op >= OpCode::RowSum) {
        if (!a.p) {
          d = Reg{nullptr, reduce(ins.op, a, cols)};
          continue;
        }
        for (int64_t r = 0; r < n_rows; ++r) out[r] = reduce(ins.op, Reg{a.p + r * cols, 0.f, a.scratch}, cols);
        d = Reg{out, 0.f, 1};
      } else if (p_.reg_is_row[ins.dst]) {
        d = elementwise(ins, a, b, c, data, tile, n_rows);
      } else if (!row_values(ins.a) && !row_values(ins.b) && !row_values(ins.c)) {
        d = elementwise(ins, a, b, c, data, tile, n_rows * cols);
      } else {
        const Reg in[3] = {a, b, c};
        const bool row_operand[3] = {row_values(ins.a), row_values(ins.b), row_values(ins.c)};
        apply_rows(ins.op, in, row_operand, out, n_rows, cols);
        d = Reg{out, 0.f, 1};
      }
    }
  }

  // Column groups (Program::outer): the full shape is a [R, C] matrix (R = the reduced leading dims, C = the
  // kept ones) and every reduction runs down its columns. A task takes a chunk of w adjacent columns and
  // a range of rows: per row it runs the full instructions over the chunk's w values (storing full outputs)
  // and folds them into w accumulators per reduction, 128 rows at a time into the running total (so a sum
  // over R rows rounds like 128 + R/128 additions, not R). Then the column instructions run over the w
  // reduced values. Where the chunks are too few to occupy every thread (a bias gradient: C = 10), the rows
  // are split too: tasks write partial results and a second pass combines them per chunk.
  void run_columns(const std::vector<View>& views, const std::vector<float>& scalars, std::vector<at::Tensor>& outs,
                   const std::vector<int64_t>& full, const std::vector<int64_t>& kept, int64_t R, int64_t C,
                   ThreadCap& cap) const {
    const int64_t k = static_cast<int64_t>(p_.outer);
    const int64_t threads = cap.available();
    const int64_t vec = Vec::size();
    std::vector<int> reductions;  // instruction indices
    for (size_t i = 0; i < p_.code.size(); ++i)
      if (p_.code[i].op >= OpCode::RowSum) reductions.push_back(static_cast<int>(i));
    const int64_t nred = static_cast<int64_t>(reductions.size());
    auto identity = [](OpCode op) {
      return op == OpCode::RowMax ? -INFINITY : op == OpCode::RowMin ? INFINITY : 0.f;
    };
    auto combine = [](OpCode op, float* acc, const float* x, int64_t n) {
      Reg ra{acc, 0.f}, rx{x, 0.f}, none{};
      apply_n(op == OpCode::RowMax ? OpCode::Max : op == OpCode::RowMin ? OpCode::Min : OpCode::Add, ra, rx, none, acc, n);
    };
    // Per input: whether its kept part is one run of a fixed stride (then `kept_stride`), else gathered.
    std::vector<int64_t> kept_stride(views.size(), 0);
    std::vector<char> linear(views.size(), 1);
    for (size_t i = 0; i < views.size(); ++i) {
      const int64_t* st = p_.inputs[i].row ? views[i].strides : views[i].strides + k;
      int64_t expect = -1;
      for (int64_t d = static_cast<int64_t>(kept.size()) - 1; d >= 0; --d) {
        if (kept[d] == 1) continue;
        if (expect < 0) kept_stride[i] = st[d];
        else if (st[d] != expect) linear[i] = 0;
        expect = st[d] * kept[d];
      }
    }
    // Up to kMaxBlockColumns columns (a channels-last batch norm's backward: [N * H * W, C] with C from 8 to
    // 2048), tiles hold blocks of whole rows (one row where a row fills a tile), so that an instruction runs
    // over hundreds of values, where chunks of a row over all rows ran it over a few vectors at a time; each
    // reduction folds a block into a block-sized accumulator that is summed into the columns every ~128 rows.
    // Every full input is then dense (a block is one run) or the same row for every row (copied block-wide
    // once). 2-core host, a ReLU and batch-norm backward group (3 inputs, 8 instructions), before / after:
    // [3136, 104] 515 / 188 us, [784, 208] 313 / 81 us; in regnet_y_400mf's training step the column groups took
    // 7.5 ms with blocks for up to 64 columns only, 4.8 ms for up to 256.
    const int64_t tile = std::max(kTile, padded(C));
    const int64_t block_rows = C > 0 && C <= kMaxBlockColumns ? tile / C : 0;
    std::vector<char> repeated(views.size(), 0);
    bool blocked = block_rows >= 1 && R >= 2 * block_rows;
    for (size_t i = 0; i < views.size() && blocked; ++i) {
      if (p_.inputs[i].row || views[i].dense) continue;
      bool lead_zero = true;
      for (int64_t d = 0; d < k; ++d) lead_zero = lead_zero && (full[d] == 1 || views[i].strides[d] == 0);
      repeated[i] = lead_zero && linear[i];
      blocked = repeated[i];
    }
    // Otherwise chunks of w columns, each over all rows (a part of them where the chunks alone are too few).
    int64_t w = padded(C), chunks = 1, parts = 1;
    if (blocked) {
      parts = std::max<int64_t>(1, std::min<int64_t>(2 * threads, R * C / 16384));
    } else {
      w = (C + 2 * threads - 1) / (2 * threads);
      w = std::min<int64_t>(kTile, std::max<int64_t>(4 * vec, (w + vec - 1) / vec * vec));
      chunks = (C + w - 1) / w;
      if (chunks < 2 * threads && R >= 512) parts = std::min<int64_t>((2 * threads + chunks - 1) / chunks, R / 256);
    }
    const int64_t rows_per_part = (R + parts - 1) / parts;
    parts = R > 0 ? (R + rows_per_part - 1) / rows_per_part : 1;

    auto load_chunk = [&](size_t i, Reg& r, float* buf, int64_t c0, int64_t n, int64_t base) {
      const View& v = views[i];
      if (linear[i]) return load_input(v, r, buf, n, base + c0 * kept_stride[i], n == 1 ? 0 : kept_stride[i]);
      gather(v, kept, c0, n, buf, p_.inputs[i].row ? v.strides : v.strides + k, base);
      r = Reg{buf, 0.f, 1};
    };

    // partial[(part * chunks... ] laid out [part][reduction][C]
    std::vector<float> partial(parts > 1 ? static_cast<size_t>(parts * nred * C) : 0);
    auto finish = [&](Scratch& s, float* acc, int64_t c0, int64_t n) {
      for (int64_t j = 0; j < nred; ++j) {
        const Instr& ins = p_.code[reductions[j]];
        float* a = acc + j * w;
        if (ins.op == OpCode::RowMean) {
          const float scale = R ? 1.f / static_cast<float>(R) : std::numeric_limits<float>::quiet_NaN();
          Reg ra{a, 0.f}, rb{nullptr, scale}, none{};
          apply_n(OpCode::Mul, ra, rb, none, a, n);
        }
        s.regs[ins.dst] = Reg{a, 0.f, 1};
      }
      for (size_t i = 0; i < views.size(); ++i)
        if (p_.inputs[i].row) load_chunk(i, s.regs[p_.inputs[i].reg], s.data.data() + static_cast<int64_t>(slot_[p_.inputs[i].reg]) * w, c0, n, 0);
      execute_phase(s.regs, s.data.data(), w, n, scalars, true, [](size_t, const Reg&) {});
      for (size_t o = 0; o < outs.size(); ++o) {
        if (!p_.outputs[o].row) continue;
        const Reg& r = s.regs[p_.outputs[o].reg];
        char* dst = static_cast<char*>(outs[o].data_ptr()) + c0 * outs[o].element_size();
        store_n(r.p, r, n, out_dtypes_[o], dst);
      }
    };

    if (blocked) {
      const int64_t flush_every = std::max<int64_t>(1, 128 / block_rows);
      at::parallel_for(0, parts, cap.grain(parts, 1), [&](int64_t begin, int64_t end) {
        Scratch& s = scratch(tile);
        thread_local std::vector<float> sums, rows;
        sums.resize(static_cast<size_t>(nred * (w + tile)));
        rows.resize(static_cast<size_t>(views.size() * tile));
        float* acc = sums.data();
        float* block = acc + nred * w;
        const int64_t span = block_rows * C;
        for (size_t i = 0; i < views.size(); ++i) {
          if (!repeated[i]) continue;
          Reg one;
          load_chunk(i, one, rows.data() + i * tile, 0, C, 0);
          float* dst = rows.data() + i * tile;
          if (!one.p) std::fill_n(dst, C, one.s);
          else if (one.p != dst) std::copy_n(one.p, C, dst);
          for (int64_t rr = 1; rr < block_rows; ++rr) std::copy_n(dst, C, dst + rr * C);
        }
        for (int64_t part = begin; part < end; ++part) {
          const int64_t r0 = part * rows_per_part, r1 = std::min(R, r0 + rows_per_part);
          for (int64_t j = 0; j < nred; ++j) {
            const float id = identity(p_.code[reductions[j]].op);
            std::fill_n(acc + j * w, C, id);
            std::fill_n(block + j * tile, span, id);
          }
          auto fold_block = [&] {
            for (int64_t j = 0; j < nred; ++j) {
              const OpCode op = p_.code[reductions[j]].op;
              float* b = block + j * tile;
              for (int64_t rr = 0; rr < block_rows; ++rr) combine(op, acc + j * w, b + rr * C, C);
              std::fill_n(b, span, identity(op));
            }
          };
          int64_t blocks = 0;
          for (int64_t r = r0; r < r1; r += block_rows) {
            const int64_t n = std::min(block_rows, r1 - r) * C;
            for (size_t i = 0; i < views.size(); ++i) {
              if (p_.inputs[i].row) continue;
              Reg& reg = s.regs[p_.inputs[i].reg];
              if (repeated[i]) reg = Reg{rows.data() + i * tile, 0.f, 1};
              else load_input(views[i], reg, s.data.data() + static_cast<int64_t>(slot_[p_.inputs[i].reg]) * tile, n, r * C, 1);
            }
            execute_phase(s.regs, s.data.data(), tile, n, scalars, false, [&](size_t at, const Reg& x) {
              const int64_t j = std::find(reductions.begin(), reductions.end(), static_cast<int>(at)) - reductions.begin();
              accumulate(p_.code[at].op, block + j * tile, x, n);
            });
            for (size_t o = 0; o < outs.size(); ++o) {
              if (p_.outputs[o].row) continue;
              const Reg& reg = s.regs[p_.outputs[o].reg];
              char* dst = static_cast<char*>(outs[o].data_ptr()) + r * C * outs[o].element_size();
              store_n(reg.p, reg, n, out_dtypes_[o], dst);
            }
            if (++blocks % flush_every == 0 || r + block_rows >= r1) fold_block();
          }
          if (parts == 1) {
            finish(s, acc, 0, C);
          } else {
            for (int64_t j = 0; j < nred; ++j) std::copy_n(acc + j * w, C, partial.data() + (part * nred + j) * C);
          }
        }
      });
    } else {
    at::parallel_for(0, chunks * parts, cap.grain(chunks * parts, 1), [&](int64_t begin, int64_t end) {
      Scratch& s = scratch(w);
      thread_local std::vector<float> sums;
      sums.resize(static_cast<size_t>(2 * nred * w));
      float* acc = sums.data();
      float* block = acc + nred * w;
      for (int64_t t = begin; t < end; ++t) {
        const int64_t chunk = t / parts, part = t % parts;
        const int64_t c0 = chunk * w, n = std::min(w, C - c0);
        const int64_t r0 = part * rows_per_part, r1 = std::min(R, r0 + rows_per_part);
        for (int64_t j = 0; j < nred; ++j) {
          std::fill_n(acc + j * w, n, identity(p_.code[reductions[j]].op));
          std::fill_n(block + j * w, n, 0.f);
        }
        for (int64_t r = r0; r < r1; ++r) {
          for (size_t i = 0; i < views.size(); ++i) {
            if (p_.inputs[i].row) continue;
            const int64_t base = leading_offset(r, full, k, views[i].strides);
            load_chunk(i, s.regs[p_.inputs[i].reg], s.data.data() + static_cast<int64_t>(slot_[p_.inputs[i].reg]) * w, c0, n, base);
          }
          const bool flush = (r - r0) % 128 == 127 || r + 1 == r1;
          // Folded where the reduction stands: its operand's slot may be reused by a later instruction.
          execute_phase(s.regs, s.data.data(), w, n, scalars, false, [&](size_t at, const Reg& x) {
            const int64_t j = std::find(reductions.begin(), reductions.end(), static_cast<int>(at)) - reductions.begin();
            const OpCode op = p_.code[at].op;
            const bool summing = op == OpCode::RowSum || op == OpCode::RowMean;
            float* into = summing ? block + j * w : acc + j * w;
            Reg ra{into, 0.f}, none{};
            apply_n(op == OpCode::RowMax ? OpCode::Max : op == OpCode::RowMin ? OpCode::Min : OpCode::Add, ra, x, none, into, n);
            if (summing && flush) {
              combine(OpCode::RowSum, acc + j * w, into, n);
              std::fill_n(into, n, 0.f);
            }
          });
          for (size_t o = 0; o < outs.size(); ++o) {
            if (p_.outputs[o].row) continue;
            const Reg& reg = s.regs[p_.outputs[o].reg];
            char* dst = static_cast<char*>(outs[o].data_ptr()) + (r * C + c0) * outs[o].element_size();
            store_n(reg.p, reg, n, out_dtypes_[o], dst);
          }
        }
        if (parts == 1) {
          finish(s, acc, c0, n);
        } else {
          for (int64_t j = 0; j < nred; ++j)
            std::copy_n(acc + j * w, n, partial.data() + (part * nred + j) * C + c0);
        }
      }
    });
    }
    if (parts == 1) return;
    at::parallel_for(0, chunks, cap.grain(chunks, 1), [&](int64_t begin, int64_t end) {
      Scratch& s = scratch(w);
      thread_local std::vector<float> sums;
      sums.resize(static_cast<size_t>(nred * w));
      for (int64_t chunk = begin; chunk < end; ++chunk) {
        const int64_t c0 = chunk * w, n = std::min(w, C - c0);
        for (int64_t j = 0; j < nred; ++j) {
          float* a = sums.data() + j * w;
          std::copy_n(partial.data() + j * C + c0, n, a);
          for (int64_t part = 1; part < parts; ++part) combine(p_.code[reductions[j]].op, a, partial.data() + (part * nred + j) * C + c0, n);
        }
        finish(s, sums.data(), c0, n);
      }
    });
  }

  // The instructions of one phase of a column group: the full ones, handing each reduction's operand
  // to `fold(instruction index, operand)`, or the column ones, which read reduced values and column
  // inputs only.
  template <class Fold>
  void execute_phase(std::vector<Reg>& regs, float* data, int64_t tile, int64_t n, const std::vector<float>& scalars,
                     bool columns, const Fold& fold) const {
    auto operand = [&](const Operand& o) { return operand_of(o, regs, scalars); };
    for (size_t at = 0; at < p_.code.size(); ++at) {
      const Instr& ins = p_.code[at];
      if (ins.op >= OpCode::RowSum) {
        if (!columns) fold(at, operand(ins.a));
        continue;
      }
      if (p_.reg_is_row[ins.dst] != columns) continue;
      Reg a = operand(ins.a), b = operand(ins.b), c = operand(ins.c);
      Reg& d = regs[ins.dst];
      d = elementwise(ins, a, b, c, data, tile, n);
    }
  }

  // Registers whose lives do not overlap share a scratch slot, so the working set of a tile is the
  // number of simultaneously live registers, not the number of instructions.
  void assign_slots() {
    const size_t nregs = p_.reg_is_row.size();
    const int64_t end = static_cast<int64_t>(p_.code.size());
    std::vector<int64_t> last_use(nregs, -1);
    auto use = [&](const Operand& o, int64_t at) {
      if (o.kind == Operand::Kind::Reg) last_use[o.index] = std::max(last_use[o.index], at);
    };
    for (int64_t i = 0; i < end; ++i) {
      use(p_.code[i].a, i);
      use(p_.code[i].b, i);
      use(p_.code[i].c, i);
    }
    for (const ProgramOutput& o : p_.outputs) last_use[o.reg] = end;  // read by the stores
    slot_.assign(nregs, -1);
    std::vector<int> free_slots;
    std::vector<std::vector<int>> release_at(end + 1);
    int next = 0;
    auto take = [&](int reg, int64_t at) {
      if (!free_slots.empty()) {
        slot_[reg] = free_slots.back();
        free_slots.pop_back();
      } else {
        slot_[reg] = next++;
      }
      release_at[std::max<int64_t>(last_use[reg], at)].push_back(slot_[reg]);
    };
    for (const ProgramInput& in : p_.inputs) take(in.reg, 0);
    for (int64_t i = 0; i < end; ++i) {
      // Operands whose last use is this instruction free their slots for its result only after it
      // runs (an instruction may read and write the same slot elementwise, which is safe).
      take(p_.code[i].dst, i);
      for (int s : release_at[i]) free_slots.push_back(s);
    }
    num_slots_ = std::max(next, 1);
  }

  Program p_;
  std::vector<int> order_;  // flat groups with permuted outputs: the dims in iteration order (constructor)
  std::vector<c10::ScalarType> out_dtypes_;
  std::vector<int> slot_;  // scratch slot of each register
  int num_slots_ = 1;
  std::unique_ptr<ThreadTuner> tuner_;  // max-autotune only
};

}  // namespace

std::shared_ptr<const Kernel> make_fused_kernel(Program program, const Tuning& tuning) {
  return std::make_shared<FusedCpuKernel>(std::move(program), tuning);
}

}  // namespace ember::cpu::EMBER_CPU_ISA
