// generate_kernels: lowers each fusion group to a Program and hands it to its device's generator
// (kernels/cpu: vectorized interpreter; kernels/cuda: NVRTC). A group a generator declines runs node
// by node through ATen.
#include "kernels/kernels.h"

#include "kernels/cpu/cpu_kernel.h"
#include "kernels/cuda/cuda_kernel.h"
#include "kernels/program.h"

#include <set>

namespace ember {

std::unordered_map<int, GroupKernel> generate_kernels(const Graph& graph, const CompileOptions& options,
                                                      std::string* listing, std::string* declined) {
  std::unordered_map<int, GroupKernel> kernels;
  std::set<int> groups;
  for (const auto& n : graph.nodes())
    if (n->group >= 0) groups.insert(n->group);
  for (int g : groups) {
    std::string why;
    std::optional<Program> program = lower_group(graph, g, &why);
    if (program) {
      if (listing) *listing += program->text();
      GroupKernel gk;
      for (const ProgramInput& in : program->inputs) gk.reads.push_back(in.value);
      for (const Value* s : program->scalars) gk.reads.push_back(s);
      for (const ProgramOutput& o : program->outputs) gk.writes.push_back(o.value);
      if (program->device.is_cpu()) gk.kernel = cpu::make_fused_kernel(std::move(*program), &why);
      else if (program->device.is_cuda()) gk.kernel = cuda::make_fused_kernel(std::move(*program), listing, &why);
      else why = "no kernel generator for " + program->device.str();
      if (gk.kernel) {
        kernels.emplace(g, std::move(gk));
        continue;
      }
    }
    if (declined) *declined += "group " + std::to_string(g) + ": " + why + "\n";
  }
  return kernels;
}

}  // namespace ember
