// Prints a fusion group's Program as CUDA C++ (see cuda_source.h for the entry points).
//
// Flat groups: the general kernel walks elements (grid-stride) and reads each input through its
// aligned strides; the vector kernel handles V elements per thread with 16-byte loads and stores
// where the call allows it, falling back per input to strided loads, and runs the tail generally.
// Row groups (reductions over the last dimension): the general kernel gives each row a block and
// recomputes the elementwise values from global memory in every pass; the register-resident
// variants read each full input once, keep it in registers, and write each output once.
// Sizes, strides and the vector choices are kernel arguments, so new shapes need no recompile.
//
// The kernel's only argument is a Params struct; its layout (printed in the source and filled by
// cuda_kernel.cpp) is: in[ni] pointers, out[no] pointers, size[rank], stride[ni][rank], numel, rows,
// cols (int64), vec, bcast, inner and one unused (uint32), period[ni] (int64), scalar[ns] (float).
// Array lengths are at least 1.
#include "kernels/cuda/cuda_source.h"

#include "ember/error.h"
#include "kernels/cuda/cuda_prelude.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace ember::cuda {
namespace {


const char* storage_type(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat: return "float";
    case c10::kHalf:
    case c10::kBFloat16: return "unsigned short";
    case c10::kBool: return "unsigned char";
    default: break;
  }
  throw Error(std::string("CUDA fused kernel: unsupported dtype ") + c10::toString(t));
}

// Storage value `raw` as float, and float `v` as storage.
std::string to_float(c10::ScalarType t, const std::string& raw) {
  switch (t) {
    case c10::kHalf: return "h2f(" + raw + ")";
    case c10::kBFloat16: return "bf2f(" + raw + ")";
    case c10::kBool: return "(" + raw + " ? 1.f : 0.f)";
    default: return raw;
  }
}

std::string from_float(c10::ScalarType t, const std::string& v) {
  switch (t) {
    case c10::kHalf: return "f2h(" + v + ")";
    case c10::kBFloat16: return "f2bf(" + v + ")";
    case c10::kBool: return "(unsigned char)((" + v + ") != 0.f)";
    default: return v;
  }
}

std::string in_ptr(c10::ScalarType t, size_t input) {
  return "((const " + std::string(storage_type(t)) + "*)p.in[" + std::to_string(input) + "])";
}

std::string out_ptr(c10::ScalarType t, size_t output) {
  return "((" + std::string(storage_type(t)) + "*)p.out[" + std::to_string(output) + "])";
}

std::string load(c10::ScalarType t, size_t input, const std::string& offset) {
  return to_float(t, in_ptr(t, input) + "[" + offset + "]");
}

std::string store(c10::ScalarType t, size_t output, const std::string& index, const std::string& v) {
  return out_ptr(t, output) + "[" + index + "] = " + from_float(t, v) + ";";
}

std::string float_literal(float f) {
  if (f != f) return "__int_as_float(0x7fffffff)";
  if (f == INFINITY) return "__int_as_float(0x7f800000)";
  if (f == -INFINITY) return "__int_as_float(0xff800000)";
  char buf[48];
  std::snprintf(buf, sizeof(buf), "%.9gf", f);
  std::string s = buf;
  if (s.find_first_of(".e") == std::string::npos) s.insert(s.size() - 1, ".0");
  return s;
}

// A string builder with stream syntax. iostreams are avoided on purpose: formatting integers through
// std::ostringstream crashed inside the Python process on the GPU machine (locale facets), while the
// same code ran in the C++ test binary.
struct Source {
  std::string s;
  Source& operator<<(const std::string& x) { s += x; return *this; }
  Source& operator<<(const char* x) { s += x; return *this; }
  Source& operator<<(size_t n) { s += std::to_string(n); return *this; }
  Source& operator<<(int n) { s += std::to_string(n); return *this; }
};

class Printer {
 public:
  explicit Printer(const Program& p) : p_(p), width_(vector_width(p)) {}

  CudaSource print(const std::string& name) {
    CudaSource out;
    out.general = name;
    out.vector_width = width_;
    Source o;
    o << kPrelude;
    o << "struct Params { const void* in[" << ni() << "]; void* out[" << no() << "]; i64 size[" << rank()
      << "]; i64 stride[" << ni() << "][" << rank() << "]; i64 numel, rows, cols; unsigned vec, bcast, inner, unused; i64 period["
      << ni() << "]; float scalar[" << ns() << "]; };\n";
    o << "extern \"C\" __global__ void " << name << "(Params p) {\n";
    if (p_.has_reduction) rows(o);
    else flat(o);
    o << "}\n";
    if (!p_.has_reduction) {
      out.vector_entry = name + "_vec";
      flat_vector(o, out.vector_entry);
    } else {
      out.rows = row_variants(name);
      if (!out.rows.empty()) rows_cached(o);
      for (const RowVariant& v : out.rows)
        o << "extern \"C\" __global__ void " << v.entry << "(Params p) { rows_cached<" << v.chunks << ", "
          << (v.mode == RowVariant::Mode::Warp ? "true" : "false") << ">(p); }\n";
    }
    out.text = std::move(o.s);
    return out;
  }

 private:
  size_t ni() const { return std::max<size_t>(p_.inputs.size(), 1); }
  size_t no() const { return std::max<size_t>(p_.outputs.size(), 1); }
  size_t ns() const { return std::max<size_t>(p_.scalars.size(), 1); }
  size_t rank() const { return std::max<size_t>(p_.rank, 1); }
  static std::string reg(int r) { return "v" + std::to_string(r); }
  static c10::ScalarType dtype(const Value* v) { return v->type.tensor.dtype; }
  c10::ScalarType in_type(size_t k) const { return dtype(p_.inputs[k].value); }
  c10::ScalarType out_type(size_t k) const { return dtype(p_.outputs[k].value); }
  static std::string str(size_t n) { return std::to_string(n); }

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
      case OpCode::Exp: return "expf(" + a + ")";
      case OpCode::Log: return "logf(" + a + ")";
      case OpCode::Log1p: return "log1pf(" + a + ")";
      case OpCode::Expm1: return "expm1f(" + a + ")";
      case OpCode::Sin: return "sinf(" + a + ")";
      case OpCode::Cos: return "cosf(" + a + ")";
      case OpCode::Tanh: return "tanhf(" + a + ")";
      case OpCode::Sigmoid: return "(1.f / (1.f + expf(-" + a + ")))";
      case OpCode::Relu: return "nan_max(" + a + ", 0.f)";
      case OpCode::Sqrt: return "sqrtf(" + a + ")";
      case OpCode::Rsqrt: return "rsqrtf(" + a + ")";
      case OpCode::Abs: return "fabsf(" + a + ")";
      case OpCode::Reciprocal: return "(1.f / " + a + ")";
      case OpCode::Erf: return "erff(" + a + ")";
      case OpCode::RoundHalf: return "h2f(f2h(" + a + "))";
      case OpCode::RoundBFloat16: return "bf2f(f2bf(" + a + "))";
      case OpCode::ToBool: return "(" + a + " != 0.f ? 1.f : 0.f)";
      case OpCode::Gelu: return "gelu_erf(" + a + ")";
      case OpCode::GeluTanh: return "gelu_tanh(" + a + ")";
      case OpCode::Silu: return "(" + a + " / (1.f + expf(-" + a + ")))";
      case OpCode::Add: return "(" + a + " + " + b + ")";
      case OpCode::Sub: return "(" + a + " - " + b + ")";
      case OpCode::Mul: return "(" + a + " * " + b + ")";
      case OpCode::Div: return "(" + a + " / " + b + ")";
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
  // shape, innermost first, times the input's aligned strides.
  void offset(Source& o, size_t k, const std::string& index, const std::string& var, const std::string& ind) {
    o << ind << "i64 " << var << " = 0;\n";
    o << ind << "{ i64 rest = " << index << ";";
    for (size_t d = p_.rank; d-- > 0;) {
      o << " { i64 c = rest % p.size[" << d << "]; rest /= p.size[" << d << "]; " << var << " += c * p.stride[" << str(k) << "]["
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
    for (size_t k = 0; k < p_.outputs.size(); ++k) o << ind << store(out_type(k), k, i, reg(p_.outputs[k].reg)) << "\n";
  }

  void flat(Source& o) {
    o << "  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < p.numel; i += (i64)gridDim.x * blockDim.x) {\n";
    element(o, "i", "    ");
    o << "  }\n";
  }

  // The flat group over vectors of V elements: outputs are contiguous and aligned; each input is read
  // with vector loads (contiguous and aligned: bit in p.vec; contiguous over the trailing p.period[k]
  // elements and repeated over the leading dimensions, a bias: bit in p.inner), once (one value for
  // all: bit in p.bcast), or element by element through its strides. The last numel % V elements run
  // the general body.
  void flat_vector(Source& o, const std::string& entry) {
    o << "extern \"C\" __global__ void " << entry << "(Params p) {\n";
    o << "  constexpr int V = " << width_ << ";\n";
    o << "  const i64 chunks = p.numel / V, step = (i64)gridDim.x * blockDim.x;\n";
    o << "  const i64 first = (i64)blockIdx.x * blockDim.x + threadIdx.x;\n";
    o << "  for (i64 c = first; c < chunks; c += step) {\n";
    o << "    const i64 i = c * V;\n";
    for (size_t k = 0; k < p_.inputs.size(); ++k) {
      const std::string a = "a" + str(k), t = storage_type(in_type(k));
      o << "    float " << a << "[V];\n";
      if (k < static_cast<size_t>(kMaxVectorInputs)) {
        o << "    if ((p.vec >> " << k << ") & 1u) {\n";
        o << "      " << t << " r[V]; ld_vec<" << t << ", V>(" << in_ptr(in_type(k), k) << " + i, r);\n";
        o << "#pragma unroll\n      for (int v = 0; v < V; ++v) " << a << "[v] = " << to_float(in_type(k), "r[v]") << ";\n";
        o << "    } else if ((p.inner >> " << k << ") & 1u) {\n";
        o << "      " << t << " r[V]; ld_vec<" << t << ", V>(" << in_ptr(in_type(k), k) << " + i % p.period[" << k << "], r);\n";
        o << "#pragma unroll\n      for (int v = 0; v < V; ++v) " << a << "[v] = " << to_float(in_type(k), "r[v]") << ";\n";
        o << "    } else if ((p.bcast >> " << k << ") & 1u) {\n";
        o << "      const float s = " << load(in_type(k), k, "0") << ";\n";
        o << "#pragma unroll\n      for (int v = 0; v < V; ++v) " << a << "[v] = s;\n";
        o << "    } else {\n";
      } else {
        o << "    {\n";
      }
      o << "#pragma unroll\n      for (int v = 0; v < V; ++v) {\n";
      offset(o, k, "i + v", "off", "        ");
      o << "        " << a << "[v] = " << load(in_type(k), k, "off") << ";\n";
      o << "      }\n    }\n";
    }
    for (size_t k = 0; k < p_.outputs.size(); ++k) o << "    float y" << k << "[V];\n";
    o << "#pragma unroll\n    for (int v = 0; v < V; ++v) {\n";
    for (size_t k = 0; k < p_.inputs.size(); ++k) o << "      float " << reg(p_.inputs[k].reg) << " = a" << k << "[v];\n";
    for (const Instr& n : p_.code) o << "      float " << reg(n.dst) << " = " << expr(n) << ";\n";
    for (size_t k = 0; k < p_.outputs.size(); ++k) o << "      y" << k << "[v] = " << reg(p_.outputs[k].reg) << ";\n";
    o << "    }\n";
    for (size_t k = 0; k < p_.outputs.size(); ++k) {
      const std::string t = storage_type(out_type(k));
      o << "    { " << t << " r[V];\n#pragma unroll\n      for (int v = 0; v < V; ++v) r[v] = " << from_float(out_type(k), "y" + str(k) + "[v]")
        << ";\n      st_vec<" << t << ", V>(" << out_ptr(out_type(k), k) << " + i, r); }\n";
    }
    o << "  }\n";
    o << "  for (i64 i = chunks * V + first; i < p.numel; i += step) {\n";
    element(o, "i", "    ");
    o << "  }\n}\n";
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

  static bool is_reduction(const Instr& i) {
    return i.op == OpCode::RowSum || i.op == OpCode::RowMean || i.op == OpCode::RowMax || i.op == OpCode::RowMin;
  }
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
      if (!p_.outputs[k].row) o << "      " << store(out_type(k), k, "row * p.cols + col", reg(p_.outputs[k].reg)) << "\n";
    o << "    }\n";
    row_outputs(o, "threadIdx.x == 0");
    o << "    __syncthreads();\n";
    o << "  }\n";
  }

  void row_outputs(Source& o, const char* writer) {
    o << "    if (" << writer << ") {\n";
    for (size_t k = 0; k < p_.outputs.size(); ++k)
      if (p_.outputs[k].row) o << "      " << store(out_type(k), k, "row", reg(p_.outputs[k].reg)) << "\n";
    o << "    }\n";
  }

  // Row kernels that read each full input once into registers: J vectors of V columns per thread,
  // thread `lane` of T holding columns (j * T + lane) * V + v. WARP: a warp per row (T = 32, shuffle
  // reductions); else a block per row (T = blockDim.x). Columns past the row's end hold 0 and are
  // neither reduced nor stored.
  void rows_cached(Source& o) {
    o << "template <int J, bool WARP> __device__ __forceinline__ void rows_cached(const Params& p) {\n";
    o << "  constexpr int V = " << width_ << ", E = J * V;\n";
    o << "  __shared__ float shared[32];\n";
    o << "  const int T = WARP ? 32 : (int)blockDim.x;\n";
    o << "  const int lane = WARP ? (int)(threadIdx.x & 31) : (int)threadIdx.x;\n";
    o << "  const i64 first = WARP ? (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5) : (i64)blockIdx.x;\n";
    o << "  const i64 step = WARP ? (i64)gridDim.x * (blockDim.x >> 5) : (i64)gridDim.x;\n";
    o << "  for (i64 row = first; row < p.rows; row += step) {\n";
    row_prologue(o);
    const size_t lead = p_.rank - 1;
    for (size_t k = 0; k < p_.inputs.size(); ++k) {
      if (p_.inputs[k].row) continue;
      const std::string x = "x" + str(k), t = storage_type(in_type(k));
      o << "    float " << x << "[E];\n";
      if (k < static_cast<size_t>(kMaxVectorInputs)) {
        o << "    if ((p.vec >> " << k << ") & 1u) {\n";
        o << "#pragma unroll\n      for (int j = 0; j < J; ++j) {\n";
        o << "        const i64 col = ((i64)j * T + lane) * V;\n";
        o << "        " << t << " r[V];\n";
        o << "        if (col < p.cols) ld_vec<" << t << ", V>(" << in_ptr(in_type(k), k) << " + b" << k << " + col, r);\n";
        o << "#pragma unroll\n        for (int v = 0; v < V; ++v) " << x << "[j * V + v] = col < p.cols ? "
          << to_float(in_type(k), "r[v]") << " : 0.f;\n";
        o << "      }\n    } else {\n";
      } else {
        o << "    {\n";
      }
      o << "#pragma unroll\n      for (int e = 0; e < E; ++e) {\n";
      o << "        const i64 col = ((i64)(e / V) * T + lane) * V + e % V;\n";
      o << "        " << x << "[e] = col < p.cols ? " << load(in_type(k), k, "b" + str(k) + " + col * p.stride[" + str(k) + "][" + str(lead) + "]")
        << " : 0.f;\n";
      o << "      }\n    }\n";
    }
    auto cached_inputs = [&](const char* ind) {
      for (size_t k = 0; k < p_.inputs.size(); ++k)
        if (!p_.inputs[k].row) o << ind << "float " << reg(p_.inputs[k].reg) << " = x" << k << "[e];\n";
    };
    for (size_t n = 0; n < p_.code.size(); ++n) {
      const Instr& i = p_.code[n];
      if (!p_.reg_is_row[i.dst]) continue;
      if (!is_reduction(i)) {
        o << "    float " << reg(i.dst) << " = " << expr(i) << ";\n";
        continue;
      }
      int kind = reduction_kind(i);
      o << "    float acc" << n << " = " << identity(kind) << ";\n";
      o << "#pragma unroll\n    for (int e = 0; e < E; ++e) {\n";
      o << "      const i64 col = ((i64)(e / V) * T + lane) * V + e % V;\n";
      o << "      if (col < p.cols) {\n";
      cached_inputs("        ");
      full_code(o, n, "        ");
      o << "        acc" << n << " = combine<" << kind << ">(acc" << n << ", " << operand(i.a) << ");\n";
      o << "      }\n    }\n";
      o << "    float " << reg(i.dst) << ";\n";
      o << "    if constexpr (WARP) " << reg(i.dst) << " = warp_reduce<" << kind << ">(acc" << n << ");\n";
      o << "    else " << reg(i.dst) << " = block_reduce<" << kind << ">(acc" << n << ", shared);\n";
      if (i.op == OpCode::RowMean) o << "    " << reg(i.dst) << " /= (float)p.cols;\n";
    }
    bool any_full_output = false;
    for (const ProgramOutput& out : p_.outputs) any_full_output |= !out.row;
    if (any_full_output) {
      for (size_t k = 0; k < p_.outputs.size(); ++k)
        if (!p_.outputs[k].row) o << "    float y" << k << "[E];\n";
      o << "#pragma unroll\n    for (int e = 0; e < E; ++e) {\n";
      cached_inputs("      ");
      full_code(o, p_.code.size(), "      ");
      for (size_t k = 0; k < p_.outputs.size(); ++k)
        if (!p_.outputs[k].row) o << "      y" << k << "[e] = " << reg(p_.outputs[k].reg) << ";\n";
      o << "    }\n";
      o << "    if (p.vec & " << std::to_string(kVectorOutputs) << "u) {\n";
      o << "#pragma unroll\n      for (int j = 0; j < J; ++j) {\n";
      o << "        const i64 col = ((i64)j * T + lane) * V;\n";
      o << "        if (col >= p.cols) continue;\n";
      for (size_t k = 0; k < p_.outputs.size(); ++k) {
        if (p_.outputs[k].row) continue;
        const std::string t = storage_type(out_type(k));
        o << "        { " << t << " r[V];\n#pragma unroll\n          for (int v = 0; v < V; ++v) r[v] = "
          << from_float(out_type(k), "y" + str(k) + "[j * V + v]") << ";\n          st_vec<" << t << ", V>("
          << out_ptr(out_type(k), k) << " + row * p.cols + col, r); }\n";
      }
      o << "      }\n    } else {\n";
      o << "#pragma unroll\n      for (int e = 0; e < E; ++e) {\n";
      o << "        const i64 col = ((i64)(e / V) * T + lane) * V + e % V;\n";
      o << "        if (col >= p.cols) continue;\n";
      for (size_t k = 0; k < p_.outputs.size(); ++k)
        if (!p_.outputs[k].row) o << "        " << store(out_type(k), k, "row * p.cols + col", "y" + str(k) + "[e]") << "\n";
      o << "      }\n    }\n";
    }
    row_outputs(o, "lane == 0");
    o << "  }\n}\n";
  }

  // The register-resident row variants worth compiling: those whose registers stay bounded, and where
  // the row length is known at compile time, only the one chosen for it.
  std::vector<RowVariant> row_variants(const std::string& name) const {
    if (p_.rank == 0) return {};
    size_t full_inputs = 0;
    for (const ProgramInput& in : p_.inputs) full_inputs += !in.row;
    std::vector<RowVariant> all;
    for (int chunks : {1, 2, 4, 8}) {
      if (static_cast<size_t>(chunks * width_) * std::max<size_t>(full_inputs, 1) > kMaxCachedValues) continue;
      all.push_back({RowVariant::Mode::Warp, chunks, name + "_w" + std::to_string(chunks)});
      if (chunks <= 2) all.push_back({RowVariant::Mode::Block, chunks, name + "_b" + std::to_string(chunks)});
    }
    std::optional<int64_t> cols = static_cols();
    if (!cols) return all;
    std::optional<RowVariant> chosen = choose_row_variant(*cols, width_, all);
    if (!chosen) return {};
    // A block variant whose registers do not allow the block it needs hands over to one with more
    // columns per thread (the launcher checks), so those come along.
    std::vector<RowVariant> kept{*chosen};
    for (const RowVariant& v : all)
      if (chosen->mode == RowVariant::Mode::Block && v.mode == RowVariant::Mode::Block && v.chunks > chosen->chunks)
        kept.push_back(v);
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

  static constexpr size_t kMaxCachedValues = 64;  // floats per thread held for the full inputs

  const Program& p_;
  int width_;
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
