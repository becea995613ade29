// generate_kernels: lowers each fusion group to a Program and hands it to its device's generator.
// CUDA groups stay with ATen until kernels/cuda exists.
#include "kernels/kernels.h"

#include "kernels/cpu/cpu_kernel.h"
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
    std::shared_ptr<const Kernel> kernel;
    if (program && program->device.is_cpu()) {
      if (listing) *listing += program->text();
      GroupKernel gk;
      for (const ProgramInput& in : program->inputs) gk.reads.push_back(in.value);
      for (const Value* s : program->scalars) gk.reads.push_back(s);
      for (const ProgramOutput& o : program->outputs) gk.writes.push_back(o.value);
      gk.kernel = cpu::make_fused_kernel(std::move(*program), &why);
      if (gk.kernel) {
        kernels.emplace(g, std::move(gk));
        continue;
      }
    } else if (program) {
      why = "no kernel generator for " + program->device.str() + " yet";
    }
    if (declined) *declined += "group " + std::to_string(g) + ": " + why + "\n";
  }
  return kernels;
}

}  // namespace ember
