// The CPU kernel generator: a fusion group's Program becomes a vectorized interpreter kernel.
#pragma once

#include "ember/runtime.h"
#include "kernels/program.h"

#include <memory>
#include <string>

namespace ember::cpu {

// Null (with the reason in *why_not) when this CPU cannot run it. Picks the widest instruction set.
std::shared_ptr<const Kernel> make_fused_kernel(Program program, std::string* why_not);

}  // namespace ember::cpu
