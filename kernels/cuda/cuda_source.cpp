// Prints a fusion group's Program as CUDA C++ (see cuda_source.h for the entry points).
//
// Flat groups: the general kernel walks elements (grid-stride) and reads each input through its
// aligned strides; the vector kernel handles V elements per thread with 16-byte loads and stores
// where the call allows it, falling back per input to strided loads, and runs the tail generally.
// Row groups (reductions over the last dimension): the general kernel gives each row a block and
// recomputes the elementwise values from global memory in every pass; the register-resident
// variants read each full input once, keep it in registers, and write each output once.
// Column groups (reductions over leading dimensions) have the general entry alone: a block per tile of
// 32 columns and chunk of rows, its warps splitting the rows (see columns()).
// Sizes, strides and the vector choices are kernel arguments, so new shapes need no recompile.
//
// The kernel's only argument is a Params struct; its layout (printed in the source and filled by
// cuda_kernel.cpp) is: in[ni] pointers, out[no] pointers, size[rank], stride[ni][rank], numel, rows,
// cols (int64), vec, bcast, inner, chan (uint32), period[ni], span[ni] (int64), scalar[ns] (float),
// and in column groups part (float*), count (uint32*), splits, chunk (int64). Array lengths are at least 1.
#include "kernels/cuda/cuda_source.h"

#include "ember/error.h"
#include "kernels/cuda/cuda_prelude.h"
#include "kernels/cuda/cuda_text.h"
#include "kernels/cuda/row_phases.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace ember::cuda {
namespace {

class Printer {
 public:
  explicit Printer(const Program& p) : p_(p), width_(vector_width(p)) {
    // A tanh whose only reader rounds it to bfloat16 may take the hardware approximation (cuda_prelude.h).
    std::vector<int> readers(p_.reg_is_row.size(), 0), rounded(p_.reg_is_row.size(), 0);
    for (const Instr& i : p_.code)
      for (const Operand* o : {&i.a, &i.b, &i.c})
        if (o->kind == Operand::Kind::Reg) {
          ++readers[o->index];
          if (i.op == OpCode::RoundBFloat16) ++rounded[o->index];
        }
    for (const ProgramOutput& o : p_.outputs) ++readers[o.reg];
    approx_tanh_.assign(p_.reg_is_row.size(), false);
    for (const Instr& i : p_.code)
      if (i.op == OpCode::Tanh) approx_tanh_[i.dst] = readers[i.dst] == 1 && rounded[i.dst] == 1;
    mark_rounded_values();
  }

  // Which values may take the fast forms of exp, sigmoid, silu, division and reciprocal (exp_fast,
  // rcp_fast, div_fast, div_row in cuda_prelude.h): those whose every use ends in a rounding to bf16 or
  // f16 (RoundBFloat16, RoundHalf, a store to a 16-bit output), directly or through products, quotients,
  // copies, and sums or means of exp/sigmoid terms (positive: softmax's exp through its row sum). A
  // relative error passes through those unchanged, and the rounding's (2^-9 bf16, 2^-12 f16) dwarfs the
  // fast forms' (exp_fast: 2^-22 plus |x| * 2^-24; the divisions 2 ulp). Values that reach a float32
  // output or an addition keep the accurate forms, and with them eager's bits. Inductor's generated code
  // uses the approximations everywhere. H100, share of copy bandwidth (kernel time), accurate -> fast:
  // bf16 softmax(x/8) 32768x1024 64% -> 80%, bf16 x*sigmoid(x)+y 85% -> 88% (f32 kernels are unchanged).
  void mark_rounded_values() {
    const size_t n = p_.reg_is_row.size();
    rounded_.assign(n, false);
    std::vector<OpCode> producer(n, OpCode::Copy);
    std::vector<bool> produced(n, false), used(n, false), ok(n, true);
    for (const Instr& i : p_.code) producer[i.dst] = i.op, produced[i.dst] = true;
    for (const ProgramOutput& o : p_.outputs) {
      used[o.reg] = true;
      if (dtype(o.value) != c10::kBFloat16 && dtype(o.value) != c10::kHalf) ok[o.reg] = false;
    }
    // Code is in dependency order: walking it backwards, every reader's verdict is made before the
    // verdicts of the values it reads.
    for (size_t k = p_.code.size(); k-- > 0;) {
      const Instr& i = p_.code[k];
      rounded_[i.dst] = used[i.dst] && ok[i.dst];
      for (const Operand* a : {&i.a, &i.b, &i.c}) {
        if (a->kind != Operand::Kind::Reg) continue;
        const int r = a->index;
        bool passes = false;
        switch (i.op) {
          case OpCode::RoundBFloat16:
          case OpCode::RoundHalf: passes = true; break;
          case OpCode::Copy:
          case OpCode::Mul:
          case OpCode::Div:
          case OpCode::Reciprocal: passes = rounded_[i.dst]; break;
          case OpCode::RowSum:
          case OpCode::RowMean:
            passes = rounded_[i.dst] && produced[r] && (producer[r] == OpCode::Exp || producer[r] == OpCode::Sigmoid);
            break;
          default: break;
        }
        used[r] = true;
        ok[r] = ok[r] && passes;
      }
    }
  }

  CudaSource print(const std::string& name) {
    CudaSource out;
    out.general = name;
    out.vector_width = width_;
    if (!p_.has_reduction && !p_.outputs.empty()) {
      const TensorType& t = p_.outputs[0].value->type.tensor;
      const std::vector<int> order = memory_order(t);
      if (!order.empty() && !std::is_sorted(order.begin(), order.end()) && t.sizes.size() <= 16) {
        for (int d = 0; d < static_cast<int>(t.sizes.size()); ++d)
          if (std::find(order.begin(), order.end(), d) == order.end()) out.iteration_order.push_back(d);  // size 1
        out.iteration_order.insert(out.iteration_order.end(), order.begin(), order.end());
      }
    }
    order_ = out.iteration_order;
    if (!p_.has_reduction) out.flat_unroll = flat_unroll();
    for (size_t k = 0; k < p_.inputs.size() && k < static_cast<size_t>(kMaxVectorInputs) && !p_.has_reduction; ++k) {
      if (broadcasts_inner(k)) out.channel_inputs |= 1u << k;
      if (broadcasts_somewhere(k)) out.repeat_inputs |= 1u << k;
    }
    repeat_inputs_ = out.repeat_inputs;
    channel_inputs_ = out.channel_inputs;
    Source o;
    o << kPrelude;
    o << "struct Params { const void* in[" << ni() << "]; void* out[" << no() << "]; i64 size[" << rank()
      << "]; i64 stride[" << ni() << "][" << rank() << "]; i64 numel, rows, cols; unsigned vec, bcast, inner, chan; i64 period["
      << ni() << "], span[" << ni() << "]; float scalar[" << ns() << "];"
      << (p_.outer > 0 ? " float* part; unsigned* count; i64 splits, chunk;" : "") << " };\n";
    const size_t header_end = o.s.size();
    o << "extern \"C\" __global__ void " << name << "(Params p) {\n";
    if (p_.outer > 0) {
      out.column_reductions = static_cast<int>(reduction_instrs().size());
      columns(o);
    }
    else if (p_.has_reduction) rows(o);
    else flat(o);
    o << "}\n";
    const size_t general_end = o.s.size();
    // The header and whatever follows the general kernel: a module without it.
    auto without_general = [&] { return o.s.substr(0, header_end) + o.s.substr(general_end); };
    if (!p_.has_reduction) {
      out.vector_entry = name + "_vec";
      out.strided_vector_entry = name + "_vec_strided";
      flat_vector(o);
      // The strided entry is a module of its own (strided_text), compiled on first use: it is a fallback
      // (misaligned or irregularly strided inputs), and it was most of the module's compile time (nvcc,
      // sm_90: resnet50's batch norm + add + relu 5.2 s with it, 0.8 s without).
      out.strided_text = without_general() + "extern \"C\" __global__ void " + out.strided_vector_entry +
                         "(Params p) { flat_vec<true>(p); }\n";
      o << "extern \"C\" __global__ void " << out.vector_entry << "(Params p) { flat_vec<false>(p); }\n";
    } else if (p_.outer == 0) {
      out.rows = row_variants(name);
      if (!out.rows.empty()) rows_cached(o);
      for (const RowVariant& v : out.rows)
        o << "extern \"C\" __global__ void "
          << launch_bounds(v) << v.entry
          << "(Params p) { rows_cached<" << v.chunks << ", "
          << (v.mode == RowVariant::Mode::Warp ? "true" : "false") << ", " << (hoists(v) ? "true" : "false") << ", "
          << (loads_ahead(v) ? "true" : "false") << ">(p); }\n";
    }
    if (!out.vector_entry.empty() || !out.rows.empty()) {
      out.general_text = o.s.substr(0, general_end);
      out.entries_text = without_general();
    }
    out.text = std::move(o.s);
    return out;
  }

 private:
  size_t ni() const { return std::max<size_t>(p_.inputs.size(), 1); }
  size_t no() const { return std::max<size_t>(p_.outputs.size(), 1); }
  size_t ns() const { return std::max<size_t>(p_.scalars.size(), 1); }
  size_t rank() const { return std::max<size_t>(p_.rank, 1); }
  // A register's name; in flat_vector's paired body, with the lane's suffix (lane_).
  std::string reg(int r) const { return "v" + std::to_string(r) + lane_; }
  static c10::ScalarType dtype(const Value* v) { return v->type.tensor.dtype; }
  c10::ScalarType in_type(size_t k) const { return dtype(p_.inputs[k].value); }
  c10::ScalarType out_type(size_t k) const { return dtype(p_.outputs[k].value); }
  static std::string str(size_t n) { return std::to_string(n); }

  // The value output k stores. A rounding to the output's own 16-bit dtype just before the store is
  // skipped: rounding twice gives the same bits as once (a NaN stores as the same NaN either way),
  // and the store rounds anyway.
  std::string stored(size_t k) const {
    const int r = p_.outputs[k].reg;
    for (const Instr& i : p_.code)
      if (i.dst == r && ((i.op == OpCode::RoundBFloat16 && out_type(k) == c10::kBFloat16) ||
                         (i.op == OpCode::RoundHalf && out_type(k) == c10::kHalf)))
        return operand(i.a);
    return reg(r);
  }

  std::string operand(const Operand& a) const {
    switch (a.kind) {
      case Operand::Kind::Reg: return reg(a.index);
      case Operand::Kind::Imm: return float_literal(a.imm);
      case Operand::Kind::Scalar: return "p.scalar[" + std::to_string(a.index) + "]";
      case Operand::Kind::None: break;
    }
    return "0.f";
  }

  std::string expr(const Instr& i) const {
    std::string a = operand(i.a), b = operand(i.b), c = operand(i.c);
    switch (i.op) {
      case OpCode::Copy: return a;
      case OpCode::Neg: return "(-" + a + ")";
      case OpCode::Exp: return (rounded_[i.dst] ? "exp_fast(" : "expf(") + a + ")";
      case OpCode::Log: return "logf(" + a + ")";
      case OpCode::Log1p: return "log1pf(" + a + ")";
      case OpCode::Expm1: return "expm1f(" + a + ")";
      case OpCode::Sin: return "sin_near(" + a + ")";
      case OpCode::Cos: return "cos_near(" + a + ")";
      case OpCode::Tanh: return (approx_tanh_[i.dst] ? "tanh_approx(" : "tanhf(") + a + ")";
      case OpCode::Sigmoid:
        return rounded_[i.dst] ? "rcp_fast(1.f + exp_fast(-" + a + "))" : "(1.f / (1.f + expf(-" + a + ")))";
      case OpCode::Relu: return "nan_max(" + a + ", 0.f)";
      case OpCode::Sqrt: return "sqrtf(" + a + ")";
      case OpCode::Rsqrt: return "rsqrtf(" + a + ")";
      case OpCode::Abs: return "fabsf(" + a + ")";
      case OpCode::Reciprocal: return rounded_[i.dst] ? "div_fast(1.f, " + a + ")" : "(1.f / " + a + ")";
      case OpCode::Erf: return "erff(" + a + ")";
      case OpCode::RoundHalf: return "h2f(f2h(" + a + "))";
      case OpCode::RoundBFloat16: return "bf_round(" + a + ")";
      case OpCode::ToBool: return "(" + a + " != 0.f ? 1.f : 0.f)";
      case OpCode::Gelu: return "gelu_erf(" + a + ")";
      case OpCode::GeluTanh: return "gelu_tanh(" + a + ")";
      case OpCode::Silu:
        return rounded_[i.dst] ? "(" + a + " * rcp_fast(1.f + exp_fast(-" + a + ")))" : "(" + a + " / (1.f + expf(-" + a + ")))";
      case OpCode::Add: return "(" + a + " + " + b + ")";
      case OpCode::Sub: return "(" + a + " - " + b + ")";
      case OpCode::Mul: return "(" + a + " * " + b + ")";
      case OpCode::Div:
        if (!rounded_[i.dst]) return "(" + a + " / " + b + ")";
        // A divisor that is one value per row (softmax's sum): its reciprocal once per row, a product per element.
        if (i.b.kind == Operand::Kind::Reg && p_.reg_is_row[i.b.index] && !p_.reg_is_row[i.dst]) return "div_row(" + a + ", " + b + ")";
        return "div_fast(" + a + ", " + b + ")";
      case OpCode::Max: return "nan_max(" + a + ", " + b + ")";
      case OpCode::Min: return "nan_min(" + a + ", " + b + ")";
      case OpCode::Pow: return "powf(" + a + ", " + b + ")";
      case OpCode::Gt: return "(" + a + " > " + b + " ? 1.f : 0.f)";
      case OpCode::Lt: return "(" + a + " < " + b + " ? 1.f : 0.f)";
      case OpCode::Ge: return "(" + a + " >= " + b + " ? 1.f : 0.f)";
      case OpCode::Le: return "(" + a + " <= " + b + " ? 1.f : 0.f)";
      case OpCode::Eq: return "(" + a + " == " + b + " ? 1.f : 0.f)";
      case OpCode::Ne: return "(" + a + " != " + b + " ? 1.f : 0.f)";
      case OpCode::GeluBackward: return "gelu_backward(" + a + ", " + b + ")";
      case OpCode::Where: return "(" + a + " != 0.f ? " + b + " : " + c + ")";
      case OpCode::MulAdd: return "fmaf(" + a + ", " + b + ", " + c + ")";
      default: break;
    }
    throw Error(std::string("CUDA codegen: no expression for ") + opcode_name(i.op));
  }

  // Offset of element `index` (an i64 expression) in input k, into `var`: its coordinates in the full
  // shape, innermost first, times the input's aligned strides. `narrow`: in 32-bit divisions, for a kernel
  // whose numel, hence every index and size, is below 2^32 (the offset itself stays 64-bit).
  void offset(Source& o, size_t k, const std::string& index, const std::string& var, const std::string& ind,
              bool narrow = false) {
    o << ind << "i64 " << var << " = 0;\n";
    if (narrow) {
      o << ind << "{ unsigned rest = (unsigned)(" << index << ");";
      for (size_t d = p_.rank; d-- > 0;)
        o << " { unsigned n = (unsigned)p.size[" << d << "], c = rest % n; rest /= n; " << var << " += (i64)c * p.stride["
          << k << "][" << d << "]; }";
    } else {
      o << ind << "{ i64 rest = " << index << ";";
      for (size_t d = p_.rank; d-- > 0;)
        o << " { i64 c = rest % p.size[" << d << "]; rest /= p.size[" << d << "]; " << var << " += c * p.stride[" << k << "]["
          << d << "]; }";
    }
    o << " }\n";
  }

  // One element of a flat group, read through the strides: the general kernel, and the vector kernel's tail.
  void element(Source& o, const std::string& i, const std::string& ind) {
    o << ind << "i64 rest = " << i << ";\n";
    for (size_t k = 0; k < p_.inputs.size(); ++k) o << ind << "i64 o" << k << " = 0;\n";
    for (size_t d = p_.rank; d-- > 0;) {
      o << ind << "{ i64 c = rest % p.size[" << d << "]; rest /= p.size[" << d << "];";
      for (size_t k = 0; k < p_.inputs.size(); ++k) o << " o" << k << " += c * p.stride[" << k << "][" << d << "];";
      o << " }\n";
    }
    for (size_t k = 0; k < p_.inputs.size(); ++k)
      o << ind << "float " << reg(p_.inputs[k].reg) << " = " << load(in_type(k), k, "o" + str(k)) << ";\n";
    for (const Instr& n : p_.code) o << ind << "float " << reg(n.dst) << " = " << expr(n) << ";\n";
    for (size_t k = 0; k < p_.outputs.size(); ++k) o << ind << store(out_type(k), k, i, stored(k)) << "\n";
  }

  void flat(Source& o) {
    o << "  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < p.numel; i += (i64)gridDim.x * blockDim.x) {\n";
    element(o, "i", "    ");
    o << "  }\n";
  }

  // The flat group over vectors of V elements: outputs are contiguous and aligned; each input is read
  // with vector loads (contiguous and aligned: bit in p.vec; contiguous over the trailing p.period[k]
  // elements and repeated over the leading dimensions, a bias: bit in p.inner), by channel (one value
  // per p.span[k] elements, p.period[k] of them repeating: NCHW's per-channel [C, 1, 1]; bit in p.chan),
  // once (one value for all: bit in p.bcast), or, in the STRIDED entry only, through its strides: a vector's
  // elements from one offset where they lie in one row (the innermost size a multiple of V), with a vector load
  // where that row is contiguous and aligned, else element by element. The last numel % V elements run one at a
  // time (tail_element).
  //
  // Each thread takes U vectors per iteration, U * blockDim.x apart (each access stays coalesced), and
  // issues every input's loads before any compute: U times the bytes in flight of one vector per thread
  // (flat grids cover their work, call_plan.h; with one wave this had kept them near copy bandwidth).
  // Loaded vectors stay packed in 32-bit words and each element converts to float where it is used. The
  // entry without strided inputs has no index arithmetic in its loop, so it needs far fewer registers
  // than the one with.
  void flat_vector(Source& o) {
    const int unroll = flat_unroll();
    o << "template <bool STRIDED> __device__ __forceinline__ void flat_vec(const Params& p) {\n";
    o << "  constexpr int V = " << width_ << ", U = " << unroll << ";\n";
    o << "  const i64 chunks = p.numel / V, step = (i64)gridDim.x * blockDim.x;\n";
    const bool rows = p_.rank >= 1;
    if (rows) {
      // Where the innermost size is a multiple of V, a vector's elements lie in one row: an input read
      // through its strides takes one offset per vector instead of one per element, and a vector load
      // where that row is contiguous and aligned (q.transpose(1, 2) of attention heads; each element's
      // 64-bit divisions had LLaMA's rotary kernel over a transposed q at 20 us on the H100, where ATen
      // took 2-3 us per op). The offset divides in 32 bits: it needs fewer than 2^32 elements.
      const std::string last = str(p_.rank - 1);
      o << "  const bool rows = p.size[" << last << "] % V == 0 && p.numel <= 0xffffffffLL;\n";
      for (size_t k = 0; k < p_.inputs.size(); ++k) {
        o << "  const bool al" << k << " = ";
        // (A vector narrower than its 32-bit words, a 1-byte input beside 8-byte ones, is read element by element.)
        if (static_cast<size_t>(width_) * c10::elementSize(in_type(k)) != 4 * static_cast<size_t>(words(in_type(k)))) {
          o << "false;\n";
          continue;
        }
        o << "rows && p.stride[" << k << "][" << last << "] == 1 && ((unsigned long long)p.in[" << k << "] & ("
          << 4 * words(in_type(k)) << " - 1)) == 0";
        for (size_t d = 0; d + 1 < p_.rank; ++d) o << " && (p.stride[" << k << "][" << d << "] & (V - 1)) == 0";
        o << ";\n";
      }
    }
    for (size_t k = 0; k < p_.inputs.size() && k < static_cast<size_t>(kMaxVectorInputs); ++k)
      o << "  const unsigned s" << k << " = (p.bcast >> " << k << ") & 1u ? splat<" << storage_type(in_type(k)) << ">("
        << in_ptr(in_type(k), k) << "[0]) : 0u;\n";
    // Inputs read as a repeating period keep their offset per vector and advance it by the loop's step
    // modulo the period (one compare), instead of dividing in every iteration: a channels_last batch
    // norm reads four per-channel inputs so, and the divisions had bound its kernel. (Periods stay
    // below 2^31, call_plan.cpp checks, so offsets are 32-bit.) Under a grid that covers the work each
    // thread runs the loop once, so its setup is most of the remainders it takes: the first vector's
    // offset and the offset between vectors (blockDim.x * V apart) cost one each, the later vectors'
    // offsets follow by one compare, and the loop's step is taken only where a second iteration exists.
    for (size_t k = 0; k < p_.inputs.size() && k < static_cast<size_t>(kMaxVectorInputs); ++k) {
      if (!((repeat_inputs_ >> k) & 1u)) continue;
      const std::string period = "(unsigned)p.period[" + str(k) + "]";
      o << "  const bool r" << k << " = (p.inner >> " << k << ") & 1u;\n";
      o << "  const unsigned rstep" << k << " = r" << k << " && step * U < chunks ? (unsigned)period_offset(step * U * V, p.period["
        << k << "]) : 0u;\n";
      o << "  unsigned roff" << k << "[U] = {};\n";
      o << "  if (r" << k << ") {\n";
      o << "    const unsigned apart = (unsigned)period_offset((i64)blockDim.x * V, p.period[" << k << "]);\n";
      o << "    roff" << k << "[0] = (unsigned)period_offset(((i64)blockIdx.x * blockDim.x * U + threadIdx.x) * V, p.period[" << k << "]);\n";
      o << "#pragma unroll\n    for (int u = 1; u < U; ++u) {\n";
      o << "      roff" << k << "[u] = roff" << k << "[u - 1] + apart;\n";
      o << "      if (roff" << k << "[u] >= " << period << ") roff" << k << "[u] -= " << period << ";\n";
      o << "    }\n";
      o << "  }\n";
    }
    // Vector u of input k into a<k>[u] (`chunk` in scope), by the mode its bits in p select.
    auto load = [&](size_t k, const std::string& ind) {
      const std::string a = "a" + str(k), t = storage_type(in_type(k)), w = str(words(in_type(k)));
      if (k < static_cast<size_t>(kMaxVectorInputs)) {
        o << ind << "if ((p.vec >> " << k << ") & 1u) ld_words<" << w << ">(" << in_ptr(in_type(k), k) << " + chunk * V, " << a << "[u]);\n";
        if ((repeat_inputs_ >> k) & 1u) {
          o << ind << "else if (r" << k << ") {\n";
          o << ind << "  ld_words<" << w << ">(" << in_ptr(in_type(k), k) << " + roff" << k << "[u], " << a << "[u]);\n";
          o << ind << "  roff" << k << "[u] += rstep" << k << ";\n";
          o << ind << "  if (roff" << k << "[u] >= (unsigned)p.period[" << k << "]) roff" << k << "[u] -= (unsigned)p.period[" << k << "];\n";
          o << ind << "}\n";
        }
        if ((channel_inputs_ >> k) & 1u)  // (each branch costs the vector entries registers: only where it may be taken)
          o << ind << "else if ((p.chan >> " << k << ") & 1u) ld_channel<" << t << ", " << w << ">(" << in_ptr(in_type(k), k)
            << ", chunk * V, p.span[" << k << "], p.period[" << k << "], " << a << "[u]);\n";
        o << ind << "else if ((p.bcast >> " << k << ") & 1u) {\n";
        o << "#pragma unroll\n" << ind << "  for (int w = 0; w < " << w << "; ++w) " << a << "[u][w] = s" << k << ";\n";
        o << ind << "} else if constexpr (STRIDED) {\n";
      } else {
        o << ind << "{\n";
      }
      std::string in = ind;
      if (rows) {
        o << ind << "  if (rows) {\n";
        offset(o, k, "chunk * V", "off", ind + "    ", /*narrow=*/true);
        o << ind << "    if (al" << k << ") ld_words<" << w << ">(" << in_ptr(in_type(k), k) << " + off, " << a << "[u]);\n";
        o << ind << "    else {\n#pragma unroll\n" << ind << "      for (int v = 0; v < V; ++v) set_elem<" << t << ">(" << a
          << "[u], v, " << in_ptr(in_type(k), k) << "[off + v * p.stride[" << k << "][" << (p_.rank - 1) << "]]);\n"
          << ind << "    }\n";
        o << ind << "  } else {\n";
        in += "  ";
      }
      o << "#pragma unroll\n" << in << "  for (int v = 0; v < V; ++v) {\n";
      offset(o, k, "chunk * V + v", "off", in + "    ");
      o << in << "    set_elem<" << t << ">(" << a << "[u], v, " << in_ptr(in_type(k), k) << "[off]);\n";
      o << in << "  }\n";
      if (rows) o << ind << "  }\n";
      o << ind << "}\n";
    };
    // Full inputs: every vector of the iteration is loaded before any compute (the bytes in flight).
    // Inputs whose type broadcasts (a bias, per-channel values: cache hits) load inside the compute
    // loop, vector by vector, so that their registers do not multiply by U.
    o << "  for (i64 base = (i64)blockIdx.x * blockDim.x * U + threadIdx.x; base < chunks; base += step * U) {\n";
    for (size_t k = 0; k < p_.inputs.size(); ++k) {
      o << "    unsigned a" << k << "[U][" << words(in_type(k)) << "] = {};\n";
      if (late_load(k)) continue;
      o << "#pragma unroll\n    for (int u = 0; u < U; ++u) {\n";
      o << "      const i64 chunk = base + (i64)u * blockDim.x;\n";
      o << "      if (chunk >= chunks) break;\n";
      load(k, "      ");
      o << "    }\n";
    }
    o << "#pragma unroll\n    for (int u = 0; u < U; ++u) {\n";
    o << "      const i64 chunk = base + (i64)u * blockDim.x;\n";
    o << "      if (chunk >= chunks) break;\n";
    for (size_t k = 0; k < p_.inputs.size(); ++k)
      if (late_load(k)) load(k, "      ");
    for (size_t k = 0; k < p_.outputs.size(); ++k) {
      o << "      unsigned y" << k << "[" << words(out_type(k)) << "] = {};\n";
      if (flat_vector_converted(k)) o << "      float f" << k << "[V];\n";  // converted a vector at once (f2bf_words)
    }
    // Two elements at a time (V is even), so that bf16 roundings go two to a conversion instruction
    // (bf_round2): with one each, the conversions bounded GPT-2's bf16 gelu_new (eight roundings per
    // element) on the H100.
    o << "#pragma unroll\n      for (int v = 0; v < V; v += 2) {\n";
    const char* lanes[2] = {"_0", "_1"};
    auto each_lane = [&](auto&& line) {
      for (int l = 0; l < 2; ++l) {
        lane_ = lanes[l];
        line(l == 0 ? std::string("v") : std::string("v + 1"));
      }
      lane_ = "";
    };
    for (size_t k = 0; k < p_.inputs.size(); ++k)
      each_lane([&](const std::string& v) {
        o << "        float " << reg(p_.inputs[k].reg) << " = "
          << to_float(in_type(k), "get_elem<" + std::string(storage_type(in_type(k))) + ">(a" + str(k) + "[u], " + v + ")") << ";\n";
      });
    for (const Instr& n : p_.code) {
      if (n.op == OpCode::RoundBFloat16) {
        std::string names[2], args[2];
        each_lane([&](const std::string& v) {
          names[v == "v" ? 0 : 1] = reg(n.dst);
          args[v == "v" ? 0 : 1] = operand(n.a);
        });
        o << "        float " << names[0] << ", " << names[1] << "; bf_round2(" << args[0] << ", " << args[1] << ", "
          << names[0] << ", " << names[1] << ");\n";
        continue;
      }
      each_lane([&](const std::string&) { o << "        float " << reg(n.dst) << " = " << expr(n) << ";\n"; });
    }
    for (size_t k = 0; k < p_.outputs.size(); ++k) {
      if (flat_vector_converted(k)) {
        each_lane([&](const std::string& v) { o << "        f" << k << "[" << v << "] = " << stored(k) << ";\n"; });
        continue;
      }
      each_lane([&](const std::string& v) {
        o << "        set_elem<" << storage_type(out_type(k)) << ">(y" << k << ", " << v << ", " << from_float(out_type(k), stored(k))
          << ");\n";
      });
    }
    o << "      }\n";
    for (size_t k = 0; k < p_.outputs.size(); ++k)
      if (flat_vector_converted(k)) o << "      f2bf_words<" << words(out_type(k)) << ">(f" << k << ", y" << k << ");\n";
    for (size_t k = 0; k < p_.outputs.size(); ++k)
      o << "      st_words<" << words(out_type(k)) << ">(" << out_ptr(out_type(k), k) << " + chunk * V, y" << k << ");\n";
    o << "    }\n  }\n";
    // Fewer than V elements, at most one per thread: left rolled (unrolled, silu + add's tail was a third
    // of its vector entry's instructions).
    o << "#pragma unroll 1\n  for (i64 i = chunks * V + (i64)blockIdx.x * blockDim.x + threadIdx.x; i < p.numel; i += step) {\n";
    tail_element(o, "    ");
    o << "  }\n}\n";
  }

  // Element i of flat_vec's tail (the last numel % V elements). Each input is read by the mode its bits
  // select, as the vector loads read it, so the entry without strided inputs has no index arithmetic
  // here either: the general body's 64-bit divisions per dimension were most of ptxas's time for a
  // small pointwise module (a copy kernel's vector entry, 2-core host: 105 ms with them, 59 without).
  void tail_element(Source& o, const std::string& ind) {
    for (size_t k = 0; k < p_.inputs.size(); ++k) {
      const std::string var = "o" + str(k);
      if (k >= static_cast<size_t>(kMaxVectorInputs)) {  // no mode bits: always through its strides
        offset(o, k, "i", var, ind);
        continue;
      }
      o << ind << "i64 " << var << " = 0;\n";
      o << ind << "if ((p.vec >> " << k << ") & 1u) " << var << " = i;\n";
      if ((repeat_inputs_ >> k) & 1u) o << ind << "else if (r" << k << ") " << var << " = period_offset(i, p.period[" << k << "]);\n";
      if ((channel_inputs_ >> k) & 1u)
        o << ind << "else if ((p.chan >> " << k << ") & 1u) " << var << " = period_offset(i / p.span[" << k << "], p.period[" << k << "]);\n";
      o << ind << "else if ((p.bcast >> " << k << ") & 1u) " << var << " = 0;\n";
      o << ind << "else if constexpr (STRIDED) {\n";
      offset(o, k, "i", "s", ind + "  ");
      o << ind << "  " << var << " = s;\n" << ind << "}\n";
    }
    for (size_t k = 0; k < p_.inputs.size(); ++k)
      o << ind << "float " << reg(p_.inputs[k].reg) << " = " << load(in_type(k), k, "o" + str(k)) << ";\n";
    for (const Instr& n : p_.code) o << ind << "float " << reg(n.dst) << " = " << expr(n) << ";\n";
    for (size_t k = 0; k < p_.outputs.size(); ++k) o << ind << store(out_type(k), k, "i", stored(k)) << "\n";
  }

  // 32-bit words holding one vector of `width_` elements of dtype t (vectors are 4 to 16 bytes).
  int words(c10::ScalarType t) const { return std::max<int>(1, width_ * static_cast<int>(c10::elementSize(t)) / 4); }

  // Vectors per thread per iteration in flat_vec: 4 for one or two full inputs (up to 128 bytes in flight
  // per thread), fewer where more inputs would hold more registers than they buy, and fewer where the
  // unrolled elements would be more code than kMaxUnrolledCost: ptxas's time grows with the copies, and
  // U changed none of the bandwidth benchmark's kernels by more than a point (README). One where an
  // element runs an op as costly as erff or logf or more (heaviest_op() >= 2): such kernels are bound by
  // instruction issue, not bytes, and U's registers cost resident blocks. BERT's f32 bias + erf GELU
  // over 1024 x 3072 (H200, generated source, one wave): U=4 47 registers, 5 blocks per multiprocessor,
  // 9.0 us; U=2 6 blocks 8.3; U=1 8 blocks 7.8 (4096 rows: 31.9, 30.5, 29.0).
  int flat_unroll() const {
    // Late-loaded inputs (inside the compute loop) count half: their registers do not multiply by U,
    // but their values do. (resnet50's bf16 batch norm + add + relu, two full and four per-channel
    // inputs: U = 2, 64 bytes in flight per thread; U = 4 took 101 registers.)
    size_t full = 0, late = 0;
    for (size_t k = 0; k < p_.inputs.size(); ++k) (late_load(k) ? late : full) += 1;
    const size_t n = std::max<size_t>(full + (late + 1) / 2, 1);
    int u = heaviest_op() >= 2 ? 1 : (n <= 2 ? 4 : (n <= 4 ? 2 : 1));
    while (u > 1 && u * width_ * element_cost() > kMaxUnrolledCost) u /= 2;
    return u;
  }

  // The code one element of a flat group compiles to, roughly, in inlined expf's: NVRTC for sm_90 on the
  // 2-core host took per unrolled copy expf 0.9 ms, sin_near 4.8, powf 4.7, logf 1.9, erff 1.7, an IEEE
  // division 1.3, tanhf 1.2, sqrtf 1.1; the fast forms and plain arithmetic are a few instructions.
  double element_cost() const {
    double cost = 0;
    for (const Instr& i : p_.code) cost += op_cost(i);
    return cost;
  }
  // The costliest single op of an element, in the same units.
  double heaviest_op() const {
    double most = 0;
    for (const Instr& i : p_.code) most = std::max(most, op_cost(i));
    return most;
  }
  double op_cost(const Instr& i) const {
    const bool fast = rounded_[i.dst];
    switch (i.op) {
      case OpCode::Sin: case OpCode::Cos: case OpCode::Pow: return 5;
      case OpCode::GeluBackward: return 3;
      case OpCode::Log: case OpCode::Log1p: case OpCode::Expm1: case OpCode::Erf: case OpCode::Gelu: return 2;
      case OpCode::Exp: return fast ? 0.2 : 1;
      case OpCode::Sigmoid: case OpCode::Silu: return fast ? 0.5 : 1.8;
      case OpCode::Div: case OpCode::Reciprocal: return fast ? 0.3 : 1.4;
      case OpCode::Tanh: return approx_tanh_[i.dst] ? 0.2 : 1.3;
      case OpCode::GeluTanh: return 1.5;
      case OpCode::Sqrt: return 1.2;
      default: return 0.1;
    }
  }

  // The elementwise values at column `col`: full inputs, then every full instruction before `end`.
  void column_body(Source& o, size_t end, const char* indent) {
    size_t lead = p_.rank - 1;
    for (size_t k = 0; k < p_.inputs.size(); ++k) {
      if (p_.inputs[k].row) continue;
      std::string off = "b" + str(k) + " + col * p.stride[" + str(k) + "][" + str(lead) + "]";
      o << indent << "float " << reg(p_.inputs[k].reg) << " = " << load(in_type(k), k, off) << ";\n";
    }
    full_code(o, end, indent);
  }

  void full_code(Source& o, size_t end, const char* indent) {
    for (size_t n = 0; n < end; ++n) {
      const Instr& i = p_.code[n];
      if (p_.reg_is_row[i.dst]) continue;
      o << indent << "float " << reg(i.dst) << " = " << expr(i) << ";\n";
    }
  }

  static bool is_reduction(const Instr& i) { return is_row_reduction(i.op); }
  static int reduction_kind(const Instr& i) { return i.op == OpCode::RowMax ? 1 : (i.op == OpCode::RowMin ? 2 : 0); }
  static const char* identity(int kind) {
    return kind == 0 ? "0.f" : (kind == 1 ? "__int_as_float(0xff800000)" : "__int_as_float(0x7f800000)");
  }

  // Per row: b<k>, the offset of input k's row (full inputs) or value (row inputs); row inputs loaded.
  void row_prologue(Source& o) {
    size_t lead = p_.rank - 1;
    o << "    i64 rest = row;\n";
    for (size_t k = 0; k < p_.inputs.size(); ++k) o << "    i64 b" << k << " = 0;\n";
    for (size_t d = lead; d-- > 0;) {
      o << "    { i64 c = rest % p.size[" << d << "]; rest /= p.size[" << d << "];";
      for (size_t k = 0; k < p_.inputs.size(); ++k) o << " b" << k << " += c * p.stride[" << k << "][" << d << "];";
      o << " }\n";
    }
    for (size_t k = 0; k < p_.inputs.size(); ++k)
      if (p_.inputs[k].row)
        o << "    float " << reg(p_.inputs[k].reg) << " = " << load(in_type(k), k, "b" + str(k)) << ";\n";
  }

  void rows(Source& o) {
    o << "  __shared__ float shared[32];\n";
    o << "  for (i64 row = blockIdx.x; row < p.rows; row += gridDim.x) {\n";
    row_prologue(o);
    for (size_t n = 0; n < p_.code.size(); ++n) {
      const Instr& i = p_.code[n];
      if (!p_.reg_is_row[i.dst]) continue;
      if (!is_reduction(i)) {
        o << "    float " << reg(i.dst) << " = " << expr(i) << ";\n";
        continue;
      }
      int kind = reduction_kind(i);
      o << "    float acc" << n << " = " << identity(kind) << ";\n";
      o << "    for (i64 col = threadIdx.x; col < p.cols; col += blockDim.x) {\n";
      column_body(o, n, "      ");
      o << "      acc" << n << " = combine<" << kind << ">(acc" << n << ", " << operand(i.a) << ");\n";
      o << "    }\n";
      o << "    float " << reg(i.dst) << " = block_reduce<" << kind << ">(acc" << n << ", shared)";
      if (i.op == OpCode::RowMean) o << " / (float)p.cols";
      o << ";\n";
    }
    o << "    for (i64 col = threadIdx.x; col < p.cols; col += blockDim.x) {\n";
    column_body(o, p_.code.size(), "      ");
    for (size_t k = 0; k < p_.outputs.size(); ++k)
      if (!p_.outputs[k].row) o << "      " << store(out_type(k), k, "row * p.cols + col", stored(k)) << "\n";
    o << "    }\n";
    row_outputs(o, "threadIdx.x == 0");
    o << "    __syncthreads();\n";
    o << "  }\n";
  }

  void row_outputs(Source& o, const char* writer) {
    o << "    if (" << writer << ") {\n";
    for (size_t k = 0; k < p_.outputs.size(); ++k)
      if (p_.outputs[k].row) o << "      " << store(out_type(k), k, "row", stored(k)) << "\n";
    o << "    }\n";
  }

  // Column groups (Program::outer): the full shape as an [R, C] matrix, R = p.cols positions of the
  // reduced leading dims by C = p.rows of the kept ones. A block of kColumnThreads threads takes tiles
  // of 32 adjacent columns (grid-stride over blockIdx.x): `lane` (threadIdx.x % 32) is the column, so a
  // warp's loads and stores of one row coalesce; the 8 warps split the block's rows (warp `rowlane`
  // takes rowlane, rowlane + 8, ...). The rows themselves split over blockIdx.y into p.splits chunks of
  // p.chunk rows, so that few columns over many rows (a bias gradient: 768 columns, 24 tiles) still fill
  // the device. Each thread computes the full values of its elements, stores the full outputs
  // (row-major over the full shape: r * C + col) and folds each reduction's operand into an accumulator
  // of its own; the 8 partial results of a column meet in shared memory. With one chunk, warp 0 then
  // runs the column instructions and stores the column outputs (at col); with several, it stores the
  // chunk's result in p.part[reduction][chunk][col] and counts the tile's chunks in p.count[tile]: the
  // block that brings the count to p.splits combines the chunks' results in chunk order (the same sum
  // whichever block ends last: deterministic), runs the epilogue and sets the count back to 0 for the
  // next launch (the launcher keeps p.count per stream, zeroed once: kernels/cuda/cuda_kernel.cpp).
  // Offsets: the kept dims' part once per column, the reduced dims' part per row; every input's
  // strides are by full dimension (call_plan.cpp puts a column input's kept-shape strides at the kept
  // dims).
  void columns(Source& o) {
    const std::vector<size_t> reductions = reduction_instrs();
    // Their partial results take 1 KiB of shared memory each (static shared memory stops at 48 KiB).
    if (reductions.size() > 32) throw Error("CUDA column kernel: more than 32 reductions in one group");
    std::vector<size_t> all, full;
    for (size_t k = 0; k < p_.inputs.size(); ++k) {
      all.push_back(k);
      if (!p_.inputs[k].row) full.push_back(k);
    }
    const int lanes = kColumnThreads / 32;
    o << "  __shared__ float partial[" << std::max<size_t>(reductions.size(), 1) << "][" << lanes << "][32];\n";
    o << "  __shared__ unsigned arrived;\n";
    o << "  const int lane = threadIdx.x & 31, rowlane = threadIdx.x >> 5;\n";
    o << "  const i64 first = (i64)blockIdx.y * p.chunk, last = min(p.cols, first + p.chunk);\n";
    o << "  for (i64 tile = blockIdx.x; tile * 32 < p.rows; tile += gridDim.x) {\n";
    o << "    const i64 col = tile * 32 + lane;\n";
    for (size_t k : all) o << "    i64 b" << k << " = 0;\n";
    dims_offsets(o, "col", p_.outer, p_.rank, all, "b", "    ");
    for (size_t j = 0; j < reductions.size(); ++j)
      o << "    float acc" << reductions[j] << " = " << identity(reduction_kind(p_.code[reductions[j]])) << ";\n";
    o << "    if (col < p.rows) {\n";
    o << "      for (i64 r = first + rowlane; r < last; r += " << lanes << ") {\n";
    for (size_t k : full) o << "        i64 o" << k << " = b" << k << ";\n";
    dims_offsets(o, "r", 0, p_.outer, full, "o", "        ");
    for (size_t k : full) o << "        float " << reg(p_.inputs[k].reg) << " = " << load(in_type(k), k, "o" + str(k)) << ";\n";
    for (size_t n = 0; n < p_.code.size(); ++n) {
      const Instr& i = p_.code[n];
      if (is_reduction(i))
        o << "        acc" << n << " = combine<" << reduction_kind(i) << ">(acc" << n << ", " << operand(i.a) << ");\n";
      else if (!p_.reg_is_row[i.dst])
        o << "        float " << reg(i.dst) << " = " << expr(i) << ";\n";
    }
    for (size_t k = 0; k < p_.outputs.size(); ++k)
      if (!p_.outputs[k].row) o << "        " << store(out_type(k), k, "r * p.rows + col", stored(k)) << "\n";
    o << "      }\n    }\n";
    for (size_t j = 0; j < reductions.size(); ++j) o << "    partial[" << j << "][rowlane][lane] = acc" << reductions[j] << ";\n";
    o << "    __syncthreads();\n";
    // Each reduction's value from the warps' results in shared memory, combined in warp order.
    auto combine_warps = [&](const std::string& ind, const std::string& declare) {
      for (size_t j = 0; j < reductions.size(); ++j) {
        const Instr& i = p_.code[reductions[j]];
        const std::string v = reg(i.dst), kind = str(reduction_kind(i));
        o << ind << declare << v << " = partial[" << j << "][0][lane];\n";
        o << "#pragma unroll\n" << ind << "for (int q = 1; q < " << lanes << "; ++q) " << v << " = combine<" << kind << ">(" << v
          << ", partial[" << j << "][q][lane]);\n";
      }
    };
    combine_warps("    ", "float ");
    o << "    if (p.splits == 1) {\n";
    o << "      if (rowlane == 0 && col < p.rows) {\n";
    column_epilogue(o, "        ");
    o << "      }\n";
    o << "    } else {\n";
    o << "      if (rowlane == 0 && col < p.rows) {\n";
    for (size_t j = 0; j < reductions.size(); ++j)
      o << "        p.part[(" << j << " * p.splits + blockIdx.y) * p.rows + col] = " << reg(p_.code[reductions[j]].dst) << ";\n";
    o << "      }\n";
    o << "      __threadfence();\n";  // this chunk's results reach every block before the count says so
    o << "      __syncthreads();\n";
    o << "      if (threadIdx.x == 0) arrived = atomicAdd(&p.count[tile], 1u);\n";
    o << "      __syncthreads();\n";
    // Every other chunk of the tile is in p.part: warp q combines chunks q, q + 8, ... of its lane's
    // column (reads from L2, side by side), warp 0 the warps' results in order.
    o << "      if (arrived == p.splits - 1) {\n";
    for (size_t j = 0; j < reductions.size(); ++j) {
      const std::string kind = str(reduction_kind(p_.code[reductions[j]]));
      o << "        {\n          float t = " << identity(reduction_kind(p_.code[reductions[j]])) << ";\n";
      o << "          if (col < p.rows)\n            for (i64 s = rowlane; s < p.splits; s += " << lanes << ") t = combine<" << kind
        << ">(t, __ldcg(&p.part[(" << j << " * p.splits + s) * p.rows + col]));\n";
      o << "          partial[" << j << "][rowlane][lane] = t;\n        }\n";
    }
    o << "        __syncthreads();\n";
    o << "        if (rowlane == 0 && col < p.rows) {\n";
    combine_warps("          ", "");
    column_epilogue(o, "          ");
    o << "        }\n";
    o << "        if (threadIdx.x == 0) p.count[tile] = 0;\n";
    o << "      }\n";
    o << "    }\n";
    o << "    __syncthreads();\n";  // partial and arrived are written again by the next tile
    o << "  }\n";
  }

  // The column instructions after the reductions (their results in place): a mean's division, the
  // column inputs' loads (at b<k>), the column values, and the column outputs' stores (at col).
  void column_epilogue(Source& o, const std::string& ind) {
    for (size_t n : reduction_instrs())
      if (p_.code[n].op == OpCode::RowMean) o << ind << reg(p_.code[n].dst) << " /= (float)p.cols;\n";  // 0 / 0: an empty mean is NaN
    for (size_t k = 0; k < p_.inputs.size(); ++k)
      if (p_.inputs[k].row) o << ind << "float " << reg(p_.inputs[k].reg) << " = " << load(in_type(k), k, "b" + str(k)) << ";\n";
    for (const Instr& i : p_.code)
      if (p_.reg_is_row[i.dst] && !is_reduction(i)) o << ind << "float " << reg(i.dst) << " = " << expr(i) << ";\n";
    for (size_t k = 0; k < p_.outputs.size(); ++k)
      if (p_.outputs[k].row) o << ind << store(out_type(k), k, "col", stored(k)) << "\n";
  }

  std::vector<size_t> reduction_instrs() const {
    std::vector<size_t> out;
    for (size_t n = 0; n < p_.code.size(); ++n)
      if (is_reduction(p_.code[n])) out.push_back(n);
    return out;
  }

  // Adds to <var><k>, for each of `inputs`, the offset of index `index` over the full dims [lo, hi)
  // (row-major): its coordinates, innermost first, times the input's strides. The outermost coordinate
  // is what remains of the index, with no division (right wherever the index is in range, as every
  // offset dereferenced is).
  void dims_offsets(Source& o, const std::string& index, size_t lo, size_t hi, const std::vector<size_t>& inputs, const std::string& var,
                    const std::string& ind) {
    if (lo >= hi) return;
    o << ind << "{\n" << ind << "  i64 rest = " << index << ";\n";
    for (size_t d = hi; d-- > lo;) {
      o << ind << "  {";
      if (d > lo) o << " i64 c = rest % p.size[" << d << "]; rest /= p.size[" << d << "];";
      else o << " i64 c = rest;";
      for (size_t k : inputs) o << " " << var << k << " += c * p.stride[" << k << "][" << d << "];";
      o << " }\n";
    }
    o << ind << "}\n";
  }

  // Row kernels that keep each full input's row in registers: J vectors of V columns per thread,
  // thread `lane` of T holding columns (j * T + lane) * V + v. WARP: a warp per row (T = 32, shuffle
  // reductions); else a block per row (T = blockDim.x). Columns past the row's end read as zeros and are
  // neither reduced nor stored.
  //
  // The row runs as phases: one per reduction, then one writing the full outputs. Each phase computes,
  // per column, only the values its result needs. What keeps registers down (and occupancy up):
  //  - inputs stay packed in 32-bit words (a bf16 vector of 8 in 4 registers) and convert where used;
  //  - an input is loaded when the first phase that needs it starts, and its registers free once the
  //    last phase that needs it is done; one that only the output phase reads (a layer norm's weight
  //    and bias) is loaded a vector at a time inside that phase's column loop; in the f32 warp
  //    variants that hoist (HOIST, hoists()), the rows every row shares load once, before the row loop;
  //  - each output vector is stored as soon as its V values are computed, not held for the whole row;
  //  - a value needed by a later phase is recomputed from the inputs unless it costs a transcendental
  //    or a division (softmax's exp), in which case the phase that first computes it keeps it (a float
  //    per column; at most kMaxKeptRows of them) in the variants where they fit in kMaxKeptValues;
  //    a value rounded to bf16 is kept packed (two per register) instead of rounded again.
  void rows_cached(Source& o) {
    o << "template <int J, bool WARP, bool HOIST, bool AHEAD> __device__ __forceinline__ void rows_cached(const Params& p) {\n";
    o << "  constexpr int V = " << width_ << ", E = J * V;\n";
    o << "  __shared__ float shared[32];\n";
    o << "  const int T = WARP ? 32 : (int)blockDim.x;\n";
    o << "  const int lane = WARP ? (int)(threadIdx.x & 31) : (int)threadIdx.x;\n";
    // A row length known here is a constant: the compiler then drops the chunks past it and their masks
    // (the entropy scorer's 768 columns in the w8 variant, 1024 wide: its module 0.31 -> 0.20 s of NVRTC
    // on the 2-core host).
    const std::optional<int64_t> fixed = static_cols();
    o << "  " << (fixed ? "constexpr int cols = " + str(*fixed) : std::string("const int cols = (int)p.cols")) << ";\n";
    // Rows of a fixed length that is no multiple of V are never vector-loaded or -stored (call_plan.cpp:
    // row_vectorizable): their vector branches are left out (ViT's softmax over 197 keys).
    row_vectors_ = !fixed || *fixed % width_ == 0;
    o << "  const i64 first = WARP ? (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5) : (i64)blockIdx.x;\n";
    o << "  const i64 step = WARP ? (i64)gridDim.x * (blockDim.x >> 5) : (i64)gridDim.x;\n";
    const RowPhases phases = plan_row_phases(p_, kMaxKeptRows);
    int kept_rows = 0;
    for (int q : phases.kept_in) kept_rows += q >= 0;
    // Kept values cost E registers each: variants with longer rows per thread recompute instead.
    o << "  constexpr bool KEEP = " << (kept_rows ? "E * " + str(kept_rows) + " <= " + str(kMaxKeptValues) : std::string("false")) << ";\n";
    int packed_rows = 0;
    for (int q : phases.packed_in) packed_rows += q >= 0;
    // Packed bf16 values cost E / 2 registers each.
    o << "  constexpr bool PACK = " << (packed_rows ? "E * " + str(packed_rows) + " <= " + str(2 * kMaxKeptValues) : std::string("false"))
      << ";\n";
    // HOIST: the rows every row shares (row_invariant: a layer norm's weight and bias, a bias added before
    // it) load once, before the loop, and each row copies its registers from there.
    for (size_t k = 0; k < p_.inputs.size(); ++k) {
      if (!row_invariant(k)) continue;
      o << "  unsigned x" << k << "h[HOIST ? J : 1][" << words(in_type(k)) << "] = {};\n";
      o << "  if constexpr (HOIST) {\n";
      load_row_words(o, k, "x" + str(k) + "h", "0");
      o << "  }\n";
    }
    // AHEAD (loads_ahead()): the next row's input loads while this row computes.
    const int ahead = ahead_input();
    if (ahead >= 0) {
      const std::string x = "x" + str(ahead) + "n";
      o << "  unsigned " << x << "[AHEAD ? J : 1][" << words(in_type(static_cast<size_t>(ahead))) << "] = {};\n";
      o << "  if constexpr (AHEAD) if (first < p.rows) {\n";
      row_offset(o, static_cast<size_t>(ahead), "first", "n");
      load_row_words(o, static_cast<size_t>(ahead), x, "n");
      o << "  }\n";
    }
    o << "  for (i64 row = first; row < p.rows; row += step) {\n";
    row_prologue(o);
    std::vector<bool> loaded(p_.inputs.size(), false);
    size_t phase = 0;
    for (size_t n = 0; n <= p_.code.size(); ++n) {
      const bool output_phase = n == p_.code.size();
      if (!output_phase) {
        const Instr& i = p_.code[n];
        if (!p_.reg_is_row[i.dst]) continue;
        if (!is_reduction(i)) {
          o << "    float " << reg(i.dst) << " = " << expr(i) << ";\n";
          continue;
        }
      } else if (phases.targets.size() == phase) {
        break;  // no full outputs
      }
      const std::vector<bool>& need = phases.needed[phase];
      // Inputs first needed by the output phase (a layer norm's weight and bias) are read a vector at a
      // time inside its column loop, not held for the whole row.
      std::vector<bool> per_chunk(p_.inputs.size(), false);
      for (size_t k = 0; k < p_.inputs.size(); ++k)
        if (!p_.inputs[k].row && need[p_.inputs[k].reg] && !loaded[k]) {
          if (output_phase)
            per_chunk[k] = true;
          else
            load_row_input(o, k);
          loaded[k] = true;
        }
      for (size_t r = 0; r < phases.kept_in.size(); ++r)
        if (phases.kept_in[r] == static_cast<int>(phase)) o << "    float k" << r << "[KEEP ? E : 1];\n";
      for (size_t r = 0; r < phases.packed_in.size(); ++r)
        if (phases.packed_in[r] == static_cast<int>(phase)) o << "    unsigned h" << r << "[PACK ? J : 1][V / 2] = {};\n";
      if (!output_phase) {
        const Instr& i = p_.code[n];
        int kind = reduction_kind(i);
        o << "    float acc" << n << " = " << identity(kind) << ";\n";
      }
      o << "#pragma unroll\n    for (int j = 0; j < J; ++j) {\n";
      o << "      const int col0 = (j * T + lane) * V;\n";
      for (size_t k = 0; k < p_.inputs.size(); ++k)
        if (per_chunk[k]) load_row_chunk(o, k);
      if (output_phase)
        for (size_t k = 0; k < p_.outputs.size(); ++k)
          if (!p_.outputs[k].row) {
            o << "      unsigned y" << k << "[" << words(out_type(k)) << "] = {};\n";
            if (vector_converted(k)) o << "      float f" << k << "[V];\n";  // converted a vector at once (f2bf_words)
          }
      // Every column is computed, those past the row's end from zeros, and only the reduction and the
      // stores are masked: branching around each column costed the unrolled code a third more registers.
      o << "#pragma unroll\n      for (int v = 0; v < V; ++v) {\n";
      for (size_t k = 0; k < p_.inputs.size(); ++k)
        if (!p_.inputs[k].row && need[p_.inputs[k].reg])
          o << "        float " << reg(p_.inputs[k].reg) << " = "
            << to_float(in_type(k), "get_elem<" + std::string(storage_type(in_type(k))) + ">(x" + str(k) + (per_chunk[k] ? "c" : "[j]") + ", v)")
            << ";\n";
      for (size_t m = 0; m < p_.code.size(); ++m) {
        const Instr& i = p_.code[m];
        if (p_.reg_is_row[i.dst] || !need[i.dst]) continue;
        const int kept_in = phases.kept_in[i.dst], packed_in = phases.packed_in[i.dst];
        if (packed_in >= 0 && packed_in < static_cast<int>(phase)) {
          o << "        float " << reg(i.dst) << ";\n";
          o << "        if constexpr (PACK) " << reg(i.dst) << " = bf2f(get_elem<unsigned short>(h" << i.dst << "[j], v)); else " << reg(i.dst)
            << " = " << expr(i) << ";\n";
          continue;
        }
        if (kept_in >= 0 && kept_in < static_cast<int>(phase)) {
          o << "        float " << reg(i.dst) << ";\n";
          o << "        if constexpr (KEEP) " << reg(i.dst) << " = k" << i.dst << "[j * V + v]; else " << reg(i.dst) << " = " << expr(i)
            << ";\n";
          continue;
        }
        o << "        float " << reg(i.dst) << " = " << expr(i) << ";\n";
        if (kept_in == static_cast<int>(phase)) o << "        if constexpr (KEEP) k" << i.dst << "[j * V + v] = " << reg(i.dst) << ";\n";
        if (packed_in == static_cast<int>(phase))
          o << "        if constexpr (PACK) set_elem<unsigned short>(h" << i.dst << "[j], v, (unsigned short)(__float_as_uint(" << reg(i.dst)
            << ") >> 16));\n";
      }
      if (!output_phase) {
        const Instr& i = p_.code[n];
        o << "        if (col0 + v < cols) acc" << n << " = combine<" << reduction_kind(i) << ">(acc" << n << ", " << operand(i.a) << ");\n";
        o << "      }\n    }\n";
        o << "    float " << reg(i.dst) << ";\n";
        o << "    if constexpr (WARP) " << reg(i.dst) << " = warp_reduce<" << reduction_kind(i) << ">(acc" << n << ");\n";
        o << "    else " << reg(i.dst) << " = block_reduce<" << reduction_kind(i) << ">(acc" << n << ", shared);\n";
        if (i.op == OpCode::RowMean) o << "    " << reg(i.dst) << " /= (float)cols;\n";
      } else {
        for (size_t k = 0; k < p_.outputs.size(); ++k) {
          if (p_.outputs[k].row) continue;
          if (vector_converted(k))
            o << "        f" << k << "[v] = " << stored(k) << ";\n";
          else
            o << "        set_elem<" << storage_type(out_type(k)) << ">(y" << k << ", v, " << from_float(out_type(k), stored(k)) << ");\n";
        }
        o << "      }\n";
        for (size_t k = 0; k < p_.outputs.size(); ++k)
          if (vector_converted(k)) o << "      f2bf_words<" << words(out_type(k)) << ">(f" << k << ", y" << k << ");\n";
        if (row_vectors_) {
          o << "      if (p.vec & " << std::to_string(kVectorOutputs) << "u) {\n";
          o << "        if (col0 < cols) {\n";
          for (size_t k = 0; k < p_.outputs.size(); ++k)
            if (!p_.outputs[k].row)
              o << "          st_words<" << words(out_type(k)) << ">(" << out_ptr(out_type(k), k) << " + row * cols + col0, y" << k << ");\n";
          o << "        }\n      } else {\n";
        } else {
          o << "      {\n";
        }
        o << "#pragma unroll\n        for (int v = 0; v < V; ++v) {\n";
        o << "          if (col0 + v >= cols) continue;\n";
        for (size_t k = 0; k < p_.outputs.size(); ++k)
          if (!p_.outputs[k].row)
            o << "          " << out_ptr(out_type(k), k) << "[row * cols + col0 + v] = get_elem<" << storage_type(out_type(k)) << ">(y"
              << k << ", v);\n";
        o << "        }\n      }\n    }\n";
      }
      ++phase;
    }
    row_outputs(o, "lane == 0");
    o << "  }\n}\n";
  }

  // Warp variants carry a register bound: left alone, ptxas schedules their unrolled columns into as
  // many registers as it likes (80-100 for softmax's w4, 237 for a 16-bit w8), which leaves a quarter of
  // the threads or fewer and too few bytes in flight. Those of one full input and one full output with
  // at most 32 values per thread (softmax, log_softmax, a scorer) are held to 64 registers (4 blocks of
  // 256 threads per multiprocessor, half its threads); rows of several full inputs held in at most 48
  // registers (held_rows_fit) to 85 (6 blocks of 128: GPT-2's bf16 residual + bias + layer norm as w4
  // takes 80 registers there and ran 18.0 us against 19.9 at 96 registers under 2 blocks of 256, H200,
  // 8192 x 768; an f32 layer norm + GELU as w8 77 registers); the rest to 128 (2 blocks of 256): tighter
  // bounds spilled (layer norm's w2 at 64, the 64-value w8 at 80). Variants that hoist the rows every
  // row shares (hoists()) to 170 (3 blocks of 128: an f32 layer norm + GELU over 1024 columns takes
  // 165). Block variants launch with up to 1024 threads, where any bound would be tight: they stay
  // unbounded. The test
  // CudaCodegen.BoundedVariantsAndColumnKernelsDoNotSpill checks every bounded variant of its corpus with
  // ptxas. call_plan.cpp launches a warp variant with the threads its bound allows.
  std::string launch_bounds(const RowVariant& v) const {
    if (v.mode != RowVariant::Mode::Warp) return "";
    size_t full_inputs = 0;
    for (const ProgramInput& in : p_.inputs) full_inputs += !in.row;
    if (v.chunks * width_ <= 32 && full_inputs <= 1 && full_outputs() <= 1) return "__launch_bounds__(256, 4) ";
    if (hoists(v)) return "__launch_bounds__(128, 3) ";
    if (full_inputs > 1 && held_rows_fit(v.chunks)) return "__launch_bounds__(128, 6) ";
    return "__launch_bounds__(256, 2) ";
  }

  // f32 and 16-bit rows of at most 32 values per thread (f32 w8, 16-bit w4) whose rows read before the
  // output phase fit in kMaxHeldWords registers.
  bool held_rows_fit(int chunks) const {
    return width_ >= 4 && chunks * width_ <= 32 && held_words(chunks, false) <= kMaxHeldWords;
  }

  // f32 warp variants whose rows held per row fit that budget once the rows every row shares are
  // hoisted (row_invariant), and the hoisted rows with them kMaxHoistedWords: those load the shared rows
  // once, before the row loop, instead of once per row (the output phase's a vector at a time, after the
  // reductions). The registers cost occupancy (3 to 5 blocks of 128 threads per multiprocessor), which
  // f32 rows, with twice the bytes in flight per register, afford and 16-bit rows did not. Generated
  // sources, H200, 16384 rows, before -> hoisted: f32 bias + layer norm over 1024 columns b1 43.0 ->
  // w8 36.7 us; layer norm + GELU 1024 w8 41.5 -> 39.8; layer norm 768 w8 31.0 -> 28.6; bf16 layer norm
  // 768 w4 19.7 -> 21.8, and GPT-2's bf16 residual + bias + layer norm w4 33.4 -> 40.6.
  bool hoists(const RowVariant& v) const {
    if (v.mode != RowVariant::Mode::Warp || width_ != 4 || v.chunks * width_ > 32) return false;
    size_t hoisted = 0;
    for (size_t k = 0; k < p_.inputs.size(); ++k)
      if (row_invariant(k)) hoisted += static_cast<size_t>(used_chunks(v.chunks) * words(in_type(k)));
    const size_t held = held_words(v.chunks, true);
    return hoisted > 0 && held <= kMaxHeldWords && held + hoisted <= kMaxHoistedWords;
  }

  // The registers a thread of `chunks` vectors holds for the rows of the full inputs that a phase before
  // the output phase reads (rows_cached loads those whole; the output phase's own a vector at a time);
  // `hoisted`: leaving out the rows every row shares, which hoists() counts apart.
  size_t held_words(int chunks, bool hoisted) const {
    const RowPhases phases = plan_row_phases(p_, kMaxKeptRows);
    chunks = used_chunks(chunks);
    size_t held = 0;
    for (size_t k = 0; k < p_.inputs.size(); ++k) {
      if (p_.inputs[k].row || (hoisted && row_invariant(k))) continue;
      for (size_t q = 0; q < phases.targets.size(); ++q)
        if (phases.targets[q] >= 0 && phases.needed[q][p_.inputs[k].reg]) {
          held += static_cast<size_t>(chunks * words(in_type(k)));
          break;
        }
    }
    return held;
  }

  // The chunks of a warp variant's row (J) that hold columns: all of them where the row length is a run-time
  // value; where the types fix it, those that start below it, since the others' loads and registers compile
  // away (`(j * T + lane) * V < cols` is false for every lane). f32 rows of 768 columns take 6 of w8's 8:
  // BERT's and GPT-2's f32 residual + bias + layer norm then hold 48 registers of rows, not 64.
  int used_chunks(int chunks) const {
    const std::optional<int64_t> cols = static_cols();
    if (!cols) return chunks;
    const int64_t per_chunk = int64_t{32} * width_;
    return static_cast<int>(std::clamp<int64_t>((*cols + per_chunk - 1) / per_chunk, 1, chunks));
  }

  // Input k's row as packed words x<k>[J][W]: copied from the hoisted x<k>h, or loaded (load_row_words).
  void load_row_input(Source& o, size_t k) {
    const std::string x = "x" + str(k), w = str(words(in_type(k)));
    o << "    unsigned " << x << "[J][" << w << "] = {};\n";
    if (row_invariant(k)) {
      o << "    if constexpr (HOIST) {\n";
      o << "#pragma unroll\n      for (int j = 0; j < J; ++j)\n";
      o << "#pragma unroll\n        for (int w = 0; w < " << w << "; ++w) " << x << "[j][w] = " << x << "h[j][w];\n";
      o << "    } else\n";
    } else if (static_cast<int>(k) == ahead_input()) {
      o << "    if constexpr (AHEAD) {\n";
      o << "#pragma unroll\n      for (int j = 0; j < J; ++j)\n";
      o << "#pragma unroll\n        for (int w = 0; w < " << w << "; ++w) " << x << "[j][w] = " << x << "n[j][w];\n";
      o << "      if (row + step < p.rows) {\n";
      o << "        const i64 next = row + step;\n";
      // Element loads OR into their words (set_elem), which still hold this row.
      o << "#pragma unroll\n        for (int j = 0; j < J; ++j)\n";
      o << "#pragma unroll\n          for (int w = 0; w < " << w << "; ++w) " << x << "n[j][w] = 0u;\n";
      row_offset(o, k, "next", "n");
      load_row_words(o, k, x + "n", "n");
      o << "      }\n";
      o << "    } else\n";
    }
    load_row_words(o, k, x, "b" + str(k));
  }

  // `var` = the element offset of full input k's row `row` (as row_prologue's b<k>).
  void row_offset(Source& o, size_t k, const std::string& row, const std::string& var) {
    o << "    i64 " << var << " = 0;\n    {\n      i64 rest = " << row << ";\n";
    for (size_t d = p_.rank - 1; d-- > 0;)
      o << "      { i64 c = rest % p.size[" << d << "]; rest /= p.size[" << d << "]; " << var << " += c * p.stride[" << k << "][" << d
        << "]; }\n";
    o << "    }\n";
  }

  // The one full input of a group with one full output (softmax, log_softmax, a scorer), if its row is
  // not the same for every row; else -1. Its warp variants may load the next row ahead (loads_ahead).
  int ahead_input() const {
    int found = -1;
    for (size_t k = 0; k < p_.inputs.size(); ++k) {
      if (p_.inputs[k].row) continue;
      if (found >= 0 || row_invariant(k)) return -1;
      found = static_cast<int>(k);
    }
    return full_outputs() <= 1 ? found : -1;
  }

  size_t full_outputs() const {
    size_t n = 0;
    for (const ProgramOutput& out : p_.outputs) n += !out.row;
    return n;
  }

  // Whether the row kernels convert full output k a vector at a time (f2bf_words): a bf16 output, the group's
  // only full one. With two (GPT-2's residual + bias + layer norm writes the sum and the norm) the vector of
  // floats held per output spilled under the 85-register bound, and the element-wise form stays.
  bool vector_converted(size_t k) const { return !p_.outputs[k].row && full_outputs() == 1 && flat_vector_converted(k); }
  // The flat kernels' test: every bf16 output.
  bool flat_vector_converted(size_t k) const { return out_type(k) == c10::kBFloat16; }

  // Warp variants of ahead_input()'s groups whose row takes at most kMaxAheadWords registers a thread: each
  // row's loads are issued a row early, into registers of their own, so that they arrive while the row before
  // computes. A warp's row is otherwise a chain (load, reduce, reduce, store) whose loads the other warps of
  // its multiprocessor (32, under the 64-register bound) do not hide. Generated source for softmax(x / 8)
  // over 32768 x 1024 bf16, w4, H200: 52.0 -> 48.6 us (its exps kept; 56.7 with them recomputed); a copy of
  // the same bytes 34.4.
  // Only where the row length is fixed (a run-time length's masks take registers) and a value rounded to bf16
  // is kept packed, which frees the input's own registers after the first phase: elsewhere (f16, rows of a
  // run-time length) ptxas spilled under the 64-register bound.
  bool loads_ahead(const RowVariant& v) const {
    const int k = ahead_input();
    if (v.mode != RowVariant::Mode::Warp || k < 0 || v.chunks * width_ > 32 || !static_cols() ||
        used_chunks(v.chunks) * words(in_type(static_cast<size_t>(k))) > kMaxAheadWords)
      return false;
    const RowPhases phases = plan_row_phases(p_, kMaxKeptRows);
    return std::any_of(phases.packed_in.begin(), phases.packed_in.end(), [](int q) { return q >= 0; });
  }

  // Input k's row from element offset `base` into the packed words `x`[J][W]: vector loads where p.vec
  // says so, else element by element (one statement).
  void load_row_words(Source& o, size_t k, const std::string& x, const std::string& base) {
    const std::string t = storage_type(in_type(k)), w = str(words(in_type(k)));
    if (k < static_cast<size_t>(kMaxVectorInputs) && row_vectors_) {
      o << "    if ((p.vec >> " << k << ") & 1u) {\n";
      o << "#pragma unroll\n      for (int j = 0; j < J; ++j)\n";
      o << "        if ((j * T + lane) * V < cols) ld_words<" << w << ">(" << in_ptr(in_type(k), k) << " + " << base
        << " + (j * T + lane) * V, " << x << "[j]);\n";
      o << "    } else {\n";
    } else {
      o << "    {\n";
    }
    o << "#pragma unroll\n      for (int j = 0; j < J; ++j)\n";
    o << "#pragma unroll\n        for (int v = 0; v < V; ++v)\n";
    o << "          if ((j * T + lane) * V + v < cols) set_elem<" << t << ">(" << x << "[j], v, " << in_ptr(in_type(k), k) << "["
      << base << " + (i64)((j * T + lane) * V + v) * p.stride[" << k << "][" << (p_.rank - 1) << "]]);\n";
    o << "    }\n";
  }

  // Full input k is the same row for every row: over each of the group's leading dimensions (p_.rank
  // of them but the last; right-aligned) it has no dimension, one of size 1 or one of stride 0.
  bool row_invariant(size_t k) const {
    if (p_.inputs[k].row || p_.rank < 2) return false;
    const TensorType& t = p_.inputs[k].value->type.tensor;
    for (size_t d = 0; d + 1 < p_.rank; ++d) {
      if (d + t.sizes.size() < p_.rank) continue;
      const size_t e = d + t.sizes.size() - p_.rank;
      const bool one = t.sizes[e].is_constant() && t.sizes[e].value == 1;
      if (!one && !(t.strides[e].is_constant() && t.strides[e].value == 0)) return false;
    }
    return true;
  }

  // Input k's dimension aligned with the group's dimension d (right-aligned), or -1 where it has none.
  int aligned_dim(size_t k, size_t d) const {
    const size_t rank = p_.inputs[k].value->type.tensor.sizes.size(), full = p_.outputs[0].value->type.tensor.sizes.size();
    return d + rank >= full ? static_cast<int>(d + rank - full) : -1;
  }
  // Whether input k broadcasts over the group's dimension d (lacks it, or has size 1 or stride 0 there
  // where the group's size is not 1).
  bool broadcast_over(size_t k, size_t d) const {
    const Dim& f = p_.outputs[0].value->type.tensor.sizes[d];
    if (f.is_constant() && f.value == 1) return false;
    const int e = aligned_dim(k, d);
    if (e < 0) return true;
    const TensorType& t = p_.inputs[k].value->type.tensor;
    return (t.sizes[e].is_constant() && t.sizes[e].value == 1) || (t.strides[e].is_constant() && t.strides[e].value == 0) ||
           !(t.sizes[e] == f);
  }
  // May be read by channel: broadcast over the innermost iterated dimension that is not 1.
  bool broadcasts_inner(size_t k) const {
    if (p_.outputs.empty()) return true;
    const std::vector<Dim>& full = p_.outputs[0].value->type.tensor.sizes;
    for (size_t i = full.size(); i-- > 0;) {
      const size_t d = order_.size() == full.size() ? static_cast<size_t>(order_[i]) : i;
      if (full[d].is_constant() && full[d].value == 1) continue;
      return broadcast_over(k, d);
    }
    return false;
  }
  // Flat vector entries load input k inside the compute loop (see flat_vector): its type broadcasts,
  // but not over the innermost dimension (a bias, channels_last per-channel values). Those that may
  // be read by channel (NCHW per-channel values) divide before their load: inside the compute loop
  // that latency showed (resnet18's batch norms, 150 -> 212 us per call on the H100), so they load
  // with the full inputs.
  bool late_load(size_t k) const {
    return k < static_cast<size_t>(kMaxVectorInputs) && broadcasts_somewhere(k) && !broadcasts_inner(k);
  }

  // May be read as a repeating period (or by channel): broadcast over some dimension.
  bool broadcasts_somewhere(size_t k) const {
    if (p_.outputs.empty()) return true;
    for (size_t d = 0; d < p_.outputs[0].value->type.tensor.sizes.size(); ++d)
      if (broadcast_over(k, d)) return true;
    return false;
  }

  // Input k's vector of the chunk at col0 as packed words x<k>c[W] (inside the column loop).
  void load_row_chunk(Source& o, size_t k) {
    const std::string x = "x" + str(k) + "c", t = storage_type(in_type(k)), w = str(words(in_type(k)));
    o << "      unsigned " << x << "[" << w << "] = {};\n";
    if (row_invariant(k)) {
      o << "      if constexpr (HOIST) {\n";
      o << "#pragma unroll\n        for (int w = 0; w < " << w << "; ++w) " << x << "[w] = x" << k << "h[j][w];\n";
      o << "      } else\n";
    }
    if (k < static_cast<size_t>(kMaxVectorInputs) && row_vectors_) {
      o << "      if ((p.vec >> " << k << ") & 1u) {\n";
      o << "        if (col0 < cols) ld_words<" << w << ">(" << in_ptr(in_type(k), k) << " + b" << k << " + col0, " << x << ");\n";
      o << "      } else {\n";
    } else {
      o << "      {\n";
    }
    o << "#pragma unroll\n        for (int v = 0; v < V; ++v)\n";
    o << "          if (col0 + v < cols) set_elem<" << t << ">(" << x << ", v, " << in_ptr(in_type(k), k) << "[b" << k
      << " + (i64)(col0 + v) * p.stride[" << k << "][" << (p_.rank - 1) << "]]);\n";
    o << "      }\n";
  }

  // The register-resident row variants worth compiling: those whose registers stay bounded, and where
  // the row length is known at compile time, only the one chosen for it.
  std::vector<RowVariant> row_variants(const std::string& name) const {
    if (p_.rank == 0) return {};
    // Every full input's row counts, including those the output phase reads a vector at a time; rows
    // may instead count the registers that hold the rows read before the output phase (16-bit packed).
    size_t full_inputs = 0;
    for (const ProgramInput& in : p_.inputs) full_inputs += !in.row;
    std::vector<RowVariant> all;
    for (int chunks : {1, 2, 4, 8}) {
      if (static_cast<size_t>(chunks * width_) * std::max<size_t>(full_inputs, 1) > kMaxCachedValues &&
          !held_rows_fit(chunks) && !hoists({RowVariant::Mode::Warp, chunks, ""}))
        continue;
      all.push_back({RowVariant::Mode::Warp, chunks, name + "_w" + std::to_string(chunks)});
      if (chunks <= 2) all.push_back({RowVariant::Mode::Block, chunks, name + "_b" + std::to_string(chunks)});
    }
    std::optional<int64_t> cols = static_cols();
    if (!cols) return all;
    std::optional<RowVariant> chosen = choose_row_variant(*cols, width_, all);
    if (!chosen) return {};
    // A block variant whose registers do not allow the block it needs hands over to one with more
    // columns per thread (the launcher checks), so those come along where that can happen. It cannot up
    // to 256 threads: ptxas gives a kernel without launch bounds at most 255 registers, and 256 threads
    // of those fit a block's 64K. (BERT's layer norms, 768 columns at 192 threads, compiled b1 and b2:
    // NVRTC took 230 ms for the module on this project's host, 117 ms for b1 alone.)
    std::vector<RowVariant> kept{*chosen};
    if (chosen->mode == RowVariant::Mode::Block && block_threads(*chosen, *cols, width_) > kAlwaysLaunchable)
      for (const RowVariant& v : all)
        if (v.mode == RowVariant::Mode::Block && v.chunks > chosen->chunks) kept.push_back(v);
    return kept;
  }

  // The row length where every full tensor of the group gives it as a constant.
  std::optional<int64_t> static_cols() const {
    std::optional<int64_t> cols;
    auto see = [&](const Value* v) {
      const std::vector<Dim>& sizes = v->type.tensor.sizes;
      if (sizes.empty()) return true;
      const Dim& last = sizes.back();
      if (!last.is_constant()) return false;
      if (last.value != 1) cols = last.value;
      return true;
    };
    for (const ProgramInput& in : p_.inputs)
      if (!in.row && !see(in.value)) return std::nullopt;
    for (const ProgramOutput& out : p_.outputs)
      if (!out.row && !see(out.value)) return std::nullopt;
    return cols ? cols : std::optional<int64_t>(1);
  }

  static int vector_width(const Program& p) {
    size_t widest = 1;
    // Row values (a layer norm's f32 mean beside f16 data) are one per row, never vector accesses.
    for (const ProgramInput& in : p.inputs)
      if (!in.row) widest = std::max(widest, c10::elementSize(dtype(in.value)));
    for (const ProgramOutput& out : p.outputs)
      if (!out.row) widest = std::max(widest, c10::elementSize(dtype(out.value)));
    return static_cast<int>(std::min<size_t>(8, 16 / widest));
  }

  static constexpr double kMaxUnrolledCost = 64;   // element_cost()'s units per thread of flat_vec's body
  static constexpr int64_t kAlwaysLaunchable = 256;  // threads any kernel's registers allow in one block
  static constexpr size_t kMaxCachedValues = 64;  // floats per thread held for the full inputs
  // Registers per thread for the rows of the inputs read before the output phase (16-bit values packed
  // two to a register). Counting values alone kept every layer norm with a weight and bias of 768 or
  // 1024 columns a block per row (b1: a barrier and a block reduction twice per row). Micro-benchmarks
  // of the generated sources, H200, 8192 rows:
  //  - GPT-2's bf16 residual + bias + layer norm, 768 columns (three such inputs, 48 registers of rows,
  //    weight and bias read in the output phase): w4 18.0 us, b1 22.6.
  //  - f32 layer norm + GELU, 1024 columns (one such input, 32 registers): w8 24.2-24.3 us, b1
  //    30.3-30.8; a layer norm of 768 columns: w8 15.0-15.3, b1 19.6-19.8.
  //  - f32 bias + layer norm, 1024 columns (64 registers, not taken): w8 22.6-22.8, b1 23.8-24.2.
  static constexpr size_t kMaxHeldWords = 48;
  // Registers per thread for the held rows and the hoisted ones together (hoists): f32 bias + layer norm
  // over 1024 columns as w8 holds four rows of 32, 154 registers under __launch_bounds__(128, 3).
  static constexpr size_t kMaxHoistedWords = 128;
  // Registers per thread for the next row's input (loads_ahead): a 16-bit row of 1024 as w4. Under the 64-register
  // bound the kept exps (32) and the packed row (16) leave no room for an f32 row of 32 words.
  static constexpr int kMaxAheadWords = 16;
  static constexpr int kMaxKeptValues = 32;         // floats per thread a row kernel keeps across phases
  static constexpr int kMaxKeptRows = 2;            // registers (rows of values) it keeps at most

  const Program& p_;
  int width_;
  std::vector<bool> approx_tanh_;  // per register: a Tanh result that is only rounded to bf16
  std::vector<bool> rounded_;      // per register: its relative error only ever reaches a 16-bit rounding
  std::vector<int> order_;         // flat groups: the iteration order (CudaSource::iteration_order)
  uint32_t repeat_inputs_ = 0;     // CudaSource::repeat_inputs
  uint32_t channel_inputs_ = 0;    // CudaSource::channel_inputs
  mutable const char* lane_ = "";
  bool row_vectors_ = true;        // rows_cached: the rows may be vector-loaded and -stored
};

}  // namespace

CudaSource generate(const Program& program, const std::string& name) { return Printer(program).print(name); }

std::string generate_source(const Program& program, const std::string& name) { return generate(program, name).text; }

std::optional<RowVariant> choose_row_variant(int64_t cols, int vector_width, const std::vector<RowVariant>& compiled,
                                             const std::function<bool(const RowVariant&)>& launchable) {
  auto find = [&](RowVariant::Mode mode, int chunks) -> const RowVariant* {
    for (const RowVariant& v : compiled)
      if (v.mode == mode && v.chunks == chunks && (!launchable || launchable(v))) return &v;
    return nullptr;
  };
  for (int chunks : {1, 2, 4, 8})
    if (cols <= int64_t{chunks} * vector_width * 32)
      if (const RowVariant* v = find(RowVariant::Mode::Warp, chunks)) return *v;
  for (int chunks : {1, 2})
    if (cols <= int64_t{chunks} * vector_width * 1024)
      if (const RowVariant* v = find(RowVariant::Mode::Block, chunks)) return *v;
  return std::nullopt;
}

int64_t block_threads(const RowVariant& v, int64_t cols, int vector_width) {
  const int64_t per_thread = int64_t{v.chunks} * vector_width;
  return ((cols + per_thread - 1) / per_thread + 31) / 32 * 32;
}

}  // namespace ember::cuda
