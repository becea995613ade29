// Code generation: one kernel per fusion group, from the generator for the group's device.
#pragma once

#include "ember/compiler.h"
#include "kernels/compile_threads.h"

#include <unordered_map>

namespace ember {

// Kernels for the fusion groups of `graph` that a generator accepts. Declined groups are reported in
// *declined (one line each: group and reason) and run node by node through ATen. `tuning`: the plan's (compiler.cpp),
// for the kernels that time how they run (max-autotune's fused CUDA kernels' launches, fused CPU kernels' threads).
std::unordered_map<int, GroupKernel> generate_kernels(const Graph& graph, const CompileOptions& options,
                                                      std::string* listing, std::string* declined,
                                                      const Tuning& tuning = {});

}  // namespace ember
