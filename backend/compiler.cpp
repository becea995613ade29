// The pipeline, in one list:
//
//   verify (and each node against its op's schema) -> canonicalize -> fold_batched_matmul -> fuse_addmm_activation
//          -> pad_matmul -> linear_chain -> fold_batchnorm -> batchnorm_pointwise -> rotate_half
//          -> eliminate_dead_code -> eliminate_common_subexpressions
//          -> claim_matmul_epilogues -> fuse -> overlap_collectives              (passes)
//          -> generate_kernels (one kernel per fusion group; a control flow node is a group of its own, its
//             kernel running the subgraphs compiled before this graph)        (codegen)
//          -> build_plan                                                       (runtime)
//
// Layout and memory planning join the list in their own passes. Each pass can be switched
// off by name; with a debug directory, the IR is written before the first pass and after each one.
#include "ember/compiler.h"

#include "ember/error.h"
#include "ember/op_table.h"
#include "kernels/cuda/driver.h"
#include "kernels/kernels.h"
#include "passes/passes.h"

#include <algorithm>
#include <chrono>
#include <fstream>

namespace ember {
namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

void dump(const CompileOptions& options, const std::string& stage, const std::string& text) {
  if (options.debug_dir.empty()) return;
  std::string path = options.debug_dir + "/" + options.graph_name + "." + stage;
  std::ofstream f(path);
  if (!f) throw Error("cannot write debug dump '" + path + "'");
  f << text;
}

}  // namespace

const std::vector<Pass>& default_passes() {
  static const std::vector<Pass> passes = {
      {"canonicalize", canonicalize},
      {"fold_matmul", fold_batched_matmul},
      {"addmm_act", fuse_addmm_activation},  // before dce, which drops the addmm it absorbed
      {"pad_mm", pad_matmul},                // after addmm_act (whose mm it may pad), before dce
      {"linear_chain", fuse_linear_chains},  // after addmm_act (whose layers it chains), before dce
      {"fold_batchnorm", fold_batchnorm},
      {"bn_pointwise", batchnorm_pointwise},  // CUDA batch norms the fold left, as pointwise ops for fuse
      {"rotate_half", rotate_half},           // rotary embeddings' cat as pointwise ops for fuse; before dce
      {"dce", eliminate_dead_code},
      {"cse", eliminate_common_subexpressions},
      {"epilogue", claim_matmul_epilogues},  // before fuse, so that fuse leaves matmul epilogues whole
      {"fuse", fuse},
      {"overlap_comm", overlap_collectives},  // last: it moves nodes only where no group's place changes
  };
  return passes;
}

std::vector<std::pair<std::string, double>> run_passes(Graph& graph, const std::vector<Pass>& passes,
                                                       PassContext& ctx) {
  std::vector<std::pair<std::string, double>> timings;
  const auto& disabled = ctx.options.disabled_passes;
  for (const std::string& name : disabled) {
    bool known = std::any_of(passes.begin(), passes.end(), [&](const Pass& p) { return name == p.name; });
    if (!known) {
      std::string names;
      for (const Pass& p : passes) names += std::string(names.empty() ? "" : ", ") + p.name;
      throw Error("unknown pass '" + name + "' in disabled passes; the passes are: " + names);
    }
  }
  int index = 0;
  for (const Pass& pass : passes) {
    ++index;
    if (std::find(disabled.begin(), disabled.end(), pass.name) != disabled.end()) continue;
    auto t0 = Clock::now();
    pass.run(graph, ctx);
    timings.emplace_back(pass.name, ms_since(t0));
    graph.verify();
    dump(ctx.options, std::to_string(index) + "_after_" + pass.name + ".ir", print(graph));
  }
  return timings;
}

std::shared_ptr<CompiledGraph> compile(Graph graph, const std::unordered_map<std::string, at::Tensor>& constants,
                                       const CompileOptions& options) {
  graph.verify();
  for (const auto& n : graph.nodes()) check_arguments(*n);
  dump(options, "0_input.ir", print(graph));
  PassContext ctx{options};
  auto timings = run_passes(graph, default_passes(), ctx);
  // Control flow nodes run as kernels of their own (runtime/control_flow.cpp): each a group of one.
  int next_group = 0;
  for (const auto& n : graph.nodes()) next_group = std::max(next_group, n->group + 1);
  for (const auto& n : graph.nodes())
    if (is_control_flow(n->op)) n->group = next_group++;
  // One budget for everything the plan times at its first calls: GEMMs, fused kernels' launches (runtime.h).
  Tuning tuning;
  if (options.autotune) {
    tuning.exhaustive = true;
    tuning.budget = std::make_shared<TuningBudget>(options.autotune_budget_s);
  }
  auto t0 = Clock::now();
  std::string listing, declined;
  const cuda::CompileStats before = cuda::compile_stats();
  auto kernels = generate_kernels(graph, options, &listing, &declined, tuning);
  timings.emplace_back("codegen", ms_since(t0));
  const cuda::CompileStats after = cuda::compile_stats();
  if (after.compiled > before.compiled || after.from_cache > before.from_cache || after.background > before.background) {
    // Parts of codegen (a name with ':' is not added to the total; NVRTC time summed over its threads).
    timings.emplace_back("codegen: nvrtc", after.nvrtc_ms - before.nvrtc_ms);
    timings.emplace_back("codegen: nvrtc cpu", after.nvrtc_cpu_ms - before.nvrtc_cpu_ms);
    timings.emplace_back("codegen: module load", after.load_ms - before.load_ms);
    // Counts, not milliseconds (report.py prints them so): modules NVRTC compiled and those read from disk,
    // and NVRTC's page faults (major, minor) and preemptions.
    timings.emplace_back("codegen: modules compiled", after.compiled - before.compiled);
    timings.emplace_back("codegen: modules from disk", after.from_cache - before.from_cache);
    // Modules still compiling when codegen returned (their NVRTC time is not in the figures above).
    timings.emplace_back("codegen: modules in background", after.background - before.background);
    timings.emplace_back("codegen: nvrtc major faults", after.nvrtc_major_faults - before.nvrtc_major_faults);
    timings.emplace_back("codegen: nvrtc minor faults", after.nvrtc_minor_faults - before.nvrtc_minor_faults);
    timings.emplace_back("codegen: nvrtc preemptions", after.nvrtc_preemptions - before.nvrtc_preemptions);
  }
  dump(options, "kernels.txt", listing + (declined.empty() ? "" : "declined:\n" + declined));
  t0 = Clock::now();
  Plan plan = build_plan(graph, constants, kernels, tuning);
  timings.emplace_back("plan", ms_since(t0));
  t0 = Clock::now();
  fold_constant_steps(plan);
  timings.emplace_back("fold", ms_since(t0));
  auto compiled = std::make_shared<CompiledGraph>(std::move(graph), std::move(plan));
  compiled->timings = std::move(timings);
  dump(options, "plan.txt", compiled->describe());
  return compiled;
}

}  // namespace ember
