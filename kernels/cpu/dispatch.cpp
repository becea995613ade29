// Picks the interpreter built for the widest instruction set this CPU runs: AVX-512 where present
// (ATen's own kernels use it there, and transcendental-heavy groups run nearly twice as fast), else AVX2.
// ATEN_CPU_CAPABILITY=avx2 (or default) caps it, as it caps ATen.
#include "kernels/cpu/cpu_kernel.h"

#include <cstdlib>
#include <cstring>

namespace ember::cpu {

namespace avx2 {
std::shared_ptr<const Kernel> make_fused_kernel(Program program);
}
namespace avx512 {
std::shared_ptr<const Kernel> make_fused_kernel(Program program);
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
}  // namespace

std::shared_ptr<const Kernel> make_fused_kernel(Program program, std::string* why_not) {
  static const Isa isa = best_isa();
  switch (isa) {
    case Isa::Avx512: return avx512::make_fused_kernel(std::move(program));
    case Isa::Avx2: return avx2::make_fused_kernel(std::move(program));
    case Isa::None: break;
  }
  if (why_not) *why_not = "this CPU lacks AVX2/FMA (or ATEN_CPU_CAPABILITY=default)";
  return nullptr;
}

}  // namespace ember::cpu
