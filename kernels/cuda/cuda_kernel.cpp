// The CUDA kernel generator: a fusion group's Program printed as CUDA C++, compiled with NVRTC when
// the plan is built, launched on ATen's current stream.
//
// Flat groups: one thread per element (grid-stride), each input read through its aligned strides.
// Row groups (with reductions over the last dimension): one block per row; every reduction is a pass
// over the row's columns that recomputes the elementwise values it needs from the inputs, then a
// warp-shuffle and shared-memory block reduction; a last pass stores the full outputs.
// Sizes and strides are kernel arguments, so new shapes need no recompile.
//
// The kernel's only argument is a Params struct; its layout (printed in the source and filled here)
// is: in[ni] pointers, out[no] pointers, size[rank], stride[ni][rank], numel, rows, cols (int64),
// scalar[ns] (float). Array lengths are at least 1.
#include "kernels/cuda/cuda_kernel.h"

#include "ember/error.h"
#include "kernels/cuda/driver.h"
#include "kernels/iteration_space.h"

#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <cstring>

namespace ember::cuda {
namespace {

constexpr const char* kPrelude = R"(
typedef long long i64;
__device__ __forceinline__ float h2f(unsigned short h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ unsigned short f2h(float f) { unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
__device__ __forceinline__ float bf2f(unsigned short b) { return __uint_as_float(((unsigned)b) << 16); }
__device__ __forceinline__ unsigned short f2bf(float f) {
  unsigned u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ float nan_max(float a, float b) { return a != a ? a : (b != b ? b : fmaxf(a, b)); }
__device__ __forceinline__ float nan_min(float a, float b) { return a != a ? a : (b != b ? b : fminf(a, b)); }
__device__ __forceinline__ float gelu_erf(float x) { return x * 0.5f * (1.f + erff(x * 0.70710678118654752f)); }
__device__ __forceinline__ float gelu_tanh(float x) { return x * 0.5f * (1.f + tanhf(0.79788456080286536f * (x + 0.044715f * x * x * x))); }
__device__ __forceinline__ float gelu_backward(float g, float x) {
  float cdf = 0.5f * (1.f + erff(x * 0.70710678118654752f));
  float pdf = expf(-0.5f * x * x) * 0.39894228040143268f;
  return g * (cdf + x * pdf);
}
template <int OP> __device__ __forceinline__ float combine(float a, float b) {
  return OP == 0 ? a + b : (OP == 1 ? nan_max(a, b) : nan_min(a, b));
}
template <int OP> __device__ float block_reduce(float v, float* shared) {
  for (int o = 16; o > 0; o >>= 1) v = combine<OP>(v, __shfl_xor_sync(0xffffffffu, v, o));
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const float identity = OP == 0 ? 0.f : (OP == 1 ? __int_as_float(0xff800000) : __int_as_float(0x7f800000));
    v = lane < (int)(blockDim.x >> 5) ? shared[lane] : identity;
    for (int o = 16; o > 0; o >>= 1) v = combine<OP>(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) shared[0] = v;
  }
  __syncthreads();
  return shared[0];
}
)";

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

std::string load(c10::ScalarType t, int input, const std::string& offset) {
  std::string p = "((const " + std::string(storage_type(t)) + "*)p.in[" + std::to_string(input) + "])[" + offset + "]";
  switch (t) {
    case c10::kHalf: return "h2f(" + p + ")";
    case c10::kBFloat16: return "bf2f(" + p + ")";
    case c10::kBool: return "(" + p + " ? 1.f : 0.f)";
    default: return p;
  }
}

std::string store(c10::ScalarType t, int output, const std::string& index, const std::string& v) {
  std::string p = "((" + std::string(storage_type(t)) + "*)p.out[" + std::to_string(output) + "])[" + index + "]";
  switch (t) {
    case c10::kHalf: return p + " = f2h(" + v + ");";
    case c10::kBFloat16: return p + " = f2bf(" + v + ");";
    case c10::kBool: return p + " = (" + v + ") != 0.f;";
    default: return p + " = " + v + ";";
  }
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
  explicit Printer(const Program& p) : p_(p) {}

  std::string source(const std::string& name) {
    Source o;
    o << kPrelude;
    o << "struct Params { const void* in[" << ni() << "]; void* out[" << no() << "]; i64 size[" << rank()
      << "]; i64 stride[" << ni() << "][" << rank() << "]; i64 numel, rows, cols; float scalar[" << ns() << "]; };\n";
    o << "extern \"C\" __global__ void " << name << "(Params p) {\n";
    if (p_.has_reduction) rows(o);
    else flat(o);
    o << "}\n";
    return o.s;
  }

 private:
  size_t ni() const { return std::max<size_t>(p_.inputs.size(), 1); }
  size_t no() const { return std::max<size_t>(p_.outputs.size(), 1); }
  size_t ns() const { return std::max<size_t>(p_.scalars.size(), 1); }
  size_t rank() const { return std::max<size_t>(p_.rank, 1); }
  static std::string reg(int r) { return "v" + std::to_string(r); }

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

  void flat(Source& o) {
    size_t r = p_.rank;
    o << "  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < p.numel; i += (i64)gridDim.x * blockDim.x) {\n";
    o << "    i64 rest = i;\n";
    for (size_t k = 0; k < p_.inputs.size(); ++k) o << "    i64 o" << k << " = 0;\n";
    for (size_t d = r; d-- > 0;) {
      o << "    { i64 c = rest % p.size[" << d << "]; rest /= p.size[" << d << "];";
      for (size_t k = 0; k < p_.inputs.size(); ++k) o << " o" << k << " += c * p.stride[" << k << "][" << d << "];";
      o << " }\n";
    }
    for (size_t k = 0; k < p_.inputs.size(); ++k)
      o << "    float " << reg(p_.inputs[k].reg) << " = " << load(p_.inputs[k].value->type.tensor.dtype, k, "o" + std::to_string(k)) << ";\n";
    for (const Instr& i : p_.code) o << "    float " << reg(i.dst) << " = " << expr(i) << ";\n";
    for (size_t k = 0; k < p_.outputs.size(); ++k)
      o << "    " << store(p_.outputs[k].value->type.tensor.dtype, k, "i", reg(p_.outputs[k].reg)) << "\n";
    o << "  }\n";
  }

  // The elementwise values at column `col`: full inputs, then every full instruction before `end`.
  void column_body(Source& o, size_t end, const char* indent) {
    size_t lead = p_.rank - 1;
    for (size_t k = 0; k < p_.inputs.size(); ++k) {
      if (p_.inputs[k].row) continue;
      std::string off = "b" + std::to_string(k) + " + col * p.stride[" + std::to_string(k) + "][" + std::to_string(lead) + "]";
      o << indent << "float " << reg(p_.inputs[k].reg) << " = " << load(p_.inputs[k].value->type.tensor.dtype, k, off) << ";\n";
    }
    for (size_t n = 0; n < end; ++n) {
      const Instr& i = p_.code[n];
      if (p_.reg_is_row[i.dst]) continue;
      o << indent << "float " << reg(i.dst) << " = " << expr(i) << ";\n";
    }
  }

  void rows(Source& o) {
    size_t lead = p_.rank - 1;
    o << "  __shared__ float shared[32];\n";
    o << "  for (i64 row = blockIdx.x; row < p.rows; row += gridDim.x) {\n";
    o << "    i64 rest = row;\n";
    for (size_t k = 0; k < p_.inputs.size(); ++k) o << "    i64 b" << k << " = 0;\n";
    for (size_t d = lead; d-- > 0;) {
      o << "    { i64 c = rest % p.size[" << d << "]; rest /= p.size[" << d << "];";
      for (size_t k = 0; k < p_.inputs.size(); ++k) o << " b" << k << " += c * p.stride[" << k << "][" << d << "];";
      o << " }\n";
    }
    for (size_t k = 0; k < p_.inputs.size(); ++k)
      if (p_.inputs[k].row)
        o << "    float " << reg(p_.inputs[k].reg) << " = " << load(p_.inputs[k].value->type.tensor.dtype, k, "b" + std::to_string(k)) << ";\n";
    for (size_t n = 0; n < p_.code.size(); ++n) {
      const Instr& i = p_.code[n];
      if (!p_.reg_is_row[i.dst]) continue;
      bool reduction = i.op == OpCode::RowSum || i.op == OpCode::RowMean || i.op == OpCode::RowMax || i.op == OpCode::RowMin;
      if (!reduction) {
        o << "    float " << reg(i.dst) << " = " << expr(i) << ";\n";
        continue;
      }
      int kind = (i.op == OpCode::RowMax) ? 1 : (i.op == OpCode::RowMin ? 2 : 0);
      const char* init = kind == 0 ? "0.f" : (kind == 1 ? "__int_as_float(0xff800000)" : "__int_as_float(0x7f800000)");
      o << "    float acc" << n << " = " << init << ";\n";
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
      if (!p_.outputs[k].row)
        o << "      " << store(p_.outputs[k].value->type.tensor.dtype, k, "row * p.cols + col", reg(p_.outputs[k].reg)) << "\n";
    o << "    }\n";
    o << "    if (threadIdx.x == 0) {\n";
    for (size_t k = 0; k < p_.outputs.size(); ++k)
      if (p_.outputs[k].row) o << "      " << store(p_.outputs[k].value->type.tensor.dtype, k, "row", reg(p_.outputs[k].reg)) << "\n";
    o << "    }\n";
    o << "    __syncthreads();\n";
    o << "  }\n";
  }

  const Program& p_;
};

class FusedCudaKernel final : public Kernel {
 public:
  FusedCudaKernel(Program program, std::string source, std::string name, void* function, int device)
      : p_(std::move(program)), source_(std::move(source)), name_(std::move(name)), function_(function), device_(device) {
    for (const ProgramOutput& o : p_.outputs) out_dtypes_.push_back(o.value->type.tensor.dtype);
  }

  std::string describe() const override {
    return "cuda fused group " + std::to_string(p_.group) + " (" + std::to_string(p_.code.size()) +
           " instructions" + (p_.has_reduction ? ", row reductions" : "") + ")";
  }

  void run(std::vector<c10::IValue>& buffers, const std::vector<uint32_t>& reads,
           const std::vector<uint32_t>& writes) const override {
    const size_t ni = p_.inputs.size(), no = p_.outputs.size(), rank = std::max<size_t>(p_.rank, 1);
    const IterationSpace space = iteration_space(p_, buffers, reads);
    const std::vector<int64_t>& full = space.full;
    const std::vector<int64_t>& row_shape = space.row_shape;
    const int64_t numel = space.numel, rows = space.rows, cols = space.cols;
    c10::Device device(c10::kCUDA, static_cast<c10::DeviceIndex>(device_));
    c10::DeviceGuard guard(device);

    // Params, laid out as the printed struct.
    std::vector<int64_t> words(std::max<size_t>(ni, 1) + std::max<size_t>(no, 1) + rank + std::max<size_t>(ni, 1) * rank + 3 +
                               (std::max<size_t>(p_.scalars.size(), 1) + 1) / 2, 0);
    size_t w = 0;
    for (size_t k = 0; k < std::max<size_t>(ni, 1); ++k, ++w)
      if (k < ni) {
        const void* ptr = buffers[reads[k]].toTensor().data_ptr();
        std::memcpy(&words[w], &ptr, sizeof(ptr));
      }
    std::vector<at::Tensor> outs;
    outs.reserve(no);
    for (size_t k = 0; k < std::max<size_t>(no, 1); ++k, ++w)
      if (k < no) {
        outs.push_back(at::empty(output_shape(p_.outputs[k], full, p_.has_reduction),
                                 at::TensorOptions().device(device).dtype(out_dtypes_[k])));
        void* ptr = outs.back().data_ptr();
        std::memcpy(&words[w], &ptr, sizeof(ptr));
      }
    for (size_t d = 0; d < rank; ++d) words[w++] = d < full.size() ? full[d] : 1;
    for (size_t k = 0; k < std::max<size_t>(ni, 1); ++k, w += rank)
      if (k < ni) {
        const at::Tensor& t = buffers[reads[k]].toTensor();
        aligned_strides(t, p_.inputs[k].row ? row_shape : full, &words[w]);
      }
    words[w++] = numel;
    words[w++] = rows;
    words[w++] = cols;
    float* scalars = reinterpret_cast<float*>(&words[w]);
    for (size_t s = 0; s < p_.scalars.size(); ++s) {
      const c10::IValue& v = buffers[reads[ni + s]];
      scalars[s] = v.isDouble() ? static_cast<float>(v.toDouble()) : v.isBool() ? float(v.toBool()) : float(v.toInt());
    }

    if (numel > 0 || (p_.has_reduction && rows > 0)) {
      void* stream = c10::impl::getDeviceGuardImpl(c10::kCUDA)->getStream(device).native_handle();
      unsigned threads = 256, blocks;
      if (p_.has_reduction) {
        threads = cols <= 64 ? 64 : (cols <= 512 ? 128 : 256);
        blocks = static_cast<unsigned>(std::min<int64_t>(rows, 1 << 20));
      } else {
        blocks = static_cast<unsigned>(std::min<int64_t>((numel + threads - 1) / threads, 1 << 20));
      }
      launch(function_, blocks, threads, stream, words.data(), device_);
    }
    for (size_t k = 0; k < no; ++k) buffers[writes[k]] = std::move(outs[k]);
  }


 private:
  Program p_;
  std::string source_, name_;
  void* function_;
  int device_;
  std::vector<c10::ScalarType> out_dtypes_;
};

}  // namespace

std::string generate_source(const Program& program, const std::string& name) { return Printer(program).source(name); }

std::shared_ptr<const Kernel> make_fused_kernel(Program program, std::string* listing, std::string* why_not,
                                                ImageStore* images) {
  if (!available(why_not)) return nullptr;
  int device = program.device.has_index() ? program.device.index() : 0;
  // One name for every kernel: the source then depends on the program alone, so identical groups (a
  // transformer's repeated layers) share one compiled module.
  std::string name = "ember_fused";
  std::string source = generate_source(program, name);
  if (listing) *listing += "// group " + std::to_string(program.group) + "\n" + source + "\n";
  void* function = compile(source, name, device, images);
  return std::make_shared<FusedCudaKernel>(std::move(program), std::move(source), std::move(name), function, device);
}

}  // namespace ember::cuda
