// Picks the interpreter built for the widest instruction set this CPU runs: AVX-512 where present
// (ATen's own kernels use it there, and transcendental-heavy groups run nearly twice as fast), else AVX2.
// ATEN_CPU_CAPABILITY=avx2 (or default) caps it, as it caps ATen. The same for the few-rows matmul.
#include "kernels/cpu/cpu_kernel.h"
#include "kernels/cpu/gemv.h"

#include <cstdlib>
#include <cstring>

namespace ember::cpu {

namespace avx2 {
std::shared_ptr<const Kernel> make_fused_kernel(Program program, const Tuning& tuning);
}
namespace avx512 {
std::shared_ptr<const Kernel> make_fused_kernel(Program program, const Tuning& tuning);
}

namespace {
enum class Isa { None, Avx2, Avx512 };

Isa best_isa() {
  const char* cap = std::getenv("ATEN_CPU_CAPABILITY");
  bool allow512 = !cap || std::strcmp(cap, "avx512") == 0;
  bool allow2 = !cap || allow512 || std::strcmp(cap, "avx2") == 0;
  if (allow512 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return Isa::Avx512;
  if (allow2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::Avx2;
  return Isa::None;
}
Isa isa() {
  static const Isa chosen = best_isa();
  return chosen;
}
}  // namespace

bool gemv_takes(const MatmulCall& c) {
  return isa() != Isa::None && c.M > 0 && c.N > 0 && c.K > 0 && c.src_stride[1] == 1 && c.weights_stride[0] == 1 &&
         c.src_stride[0] >= c.K && c.weights_stride[1] >= c.K;
}

void gemv(const MatmulConfig& config, const MatmulCall& call) {
  if (isa() == Isa::Avx512) return avx512::gemv(config, call);
  return avx2::gemv(config, call);
}

std::shared_ptr<const Kernel> make_fused_kernel(Program program, std::string* why_not, const Tuning& tuning) {
  switch (isa()) {
    case Isa::Avx512: return avx512::make_fused_kernel(std::move(program), tuning);
    case Isa::Avx2: return avx2::make_fused_kernel(std::move(program), tuning);
    case Isa::None: break;
  }
  if (why_not) *why_not = "this CPU lacks AVX2/FMA (or ATEN_CPU_CAPABILITY=default)";
  return nullptr;
}

}  // namespace ember::cpu
