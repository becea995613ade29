// generate_kernels: lowers each fusion group to a Program and hands it to its device's generator
// (kernels/cpu: vectorized interpreter; kernels/cuda: NVRTC), and each claimed matmul group to its library
// call (kernels/cpu: oneDNN). A group a generator declines runs node by node through ATen.
#include "kernels/kernels.h"

#include "ember/config.h"
#include "ember/op_table.h"

#include "kernels/cpu/cpu_kernel.h"
#include "kernels/cuda/cuda_kernel.h"
#include "kernels/epilogue_group.h"
#include "kernels/program.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <set>
#include <thread>

namespace ember {

size_t compile_threads() {
  static const size_t threads = [] {
    const std::optional<std::string> v = config_value("EMBER_COMPILE_THREADS");
    long n = v ? std::strtol(v->c_str(), nullptr, 10) : 0;
    return n > 0 ? static_cast<size_t>(n) : std::max(1u, std::thread::hardware_concurrency());
  }();
  return threads;
}

namespace {

// Runs make(i) for i in [0, n) on up to compile_threads() threads: NVRTC compiles of distinct groups
// overlap instead of queueing (the CPU generator is cheap and gains nothing, but shares the path).
template <class F>
void parallel_for_each(size_t n, F make) {
  size_t workers = std::min(n, compile_threads());
  if (workers <= 1) {
    for (size_t i = 0; i < n; ++i) make(i);
    return;
  }
  std::atomic<size_t> next{0};
  std::vector<std::thread> threads;
  for (size_t w = 0; w < workers; ++w)
    threads.emplace_back([&] {
      for (size_t i = next++; i < n; i = next++) make(i);
    });
  for (auto& t : threads) t.join();
}

// The ember::fold_batchnorm node that makes up `group` on its own (passes/fold_batchnorm.cpp), or null.
const Node* fold_batchnorm_node(const Graph& graph, int group) {
  for (const auto& n : graph.nodes())
    if (n->group == group) return n->op == "ember::fold_batchnorm" ? n.get() : nullptr;
  return nullptr;
}

// The ember::cond / while_loop / scan node that makes up `group` on its own (compiler.cpp), or null.
const Node* control_flow_node(const Graph& graph, int group) {
  for (const auto& n : graph.nodes())
    if (n->group == group) return is_control_flow(n->op) ? n.get() : nullptr;
  return nullptr;
}

}  // namespace

std::unordered_map<int, GroupKernel> generate_kernels(const Graph& graph, const CompileOptions& options,
                                                      std::string* listing, std::string* declined, const Tuning& tuning) {
  std::set<int> ids;
  for (const auto& n : graph.nodes())
    if (n->group >= 0) ids.insert(n->group);
  std::vector<int> groups(ids.begin(), ids.end());

  struct Result {
    GroupKernel kernel;
    std::string listing, why;
  };
  std::vector<Result> results(groups.size());
  parallel_for_each(groups.size(), [&](size_t i) {
    Result& r = results[i];
    try {
      if (const Node* flow = control_flow_node(graph, groups[i])) {
        r.listing = "group " + std::to_string(groups[i]) + ": " + flow->op + "\n";
        r.kernel = make_control_flow_kernel(*flow, options.subgraphs);
        return;
      }
      if (const Node* fold = fold_batchnorm_node(graph, groups[i])) {
        r.listing = "group " + std::to_string(groups[i]) + ": fold_batchnorm\n";
        fold->for_each_input([&](const Value* v) { r.kernel.reads.push_back(v); });
        r.kernel.writes = {fold->outputs[0], fold->outputs[1]};
        r.kernel.kernel = cpu::make_fold_batchnorm_kernel(*fold, &r.why);
        return;
      }
      if (is_epilogue_group(graph, groups[i])) {
        std::optional<EpilogueGroup> m = lower_epilogue_group(graph, groups[i], &r.why, options.unversioned_inputs);
        if (!m) return;
        r.listing = "group " + std::to_string(groups[i]) + ": " + m->text() + "\n";
        r.kernel.reads = m->reads();
        r.kernel.writes = {m->output};
        if (m->device.is_cpu() && m->kind == EpilogueGroup::Kind::Conv2d) r.kernel.kernel = cpu::make_conv2d_kernel(*m, &r.why);
        else if (m->device.is_cpu()) r.kernel.kernel = cpu::make_matmul_kernel(*m, &r.why, options.autotune);
        else r.why = "no library epilogue for " + m->device.str() + " matmuls yet";
        return;
      }
      std::optional<Program> program = lower_group(graph, groups[i], &r.why);
      if (!program) return;
      r.listing = program->text();
      for (const ProgramInput& in : program->inputs) r.kernel.reads.push_back(in.value);
      for (const Value* s : program->scalars) r.kernel.reads.push_back(s);
      for (const ProgramOutput& o : program->outputs) r.kernel.writes.push_back(o.value);
      if (program->device.is_cpu()) r.kernel.kernel = cpu::make_fused_kernel(std::move(*program), &r.why, tuning);
      else if (program->device.is_cuda()) r.kernel.kernel = cuda::make_fused_kernel(std::move(*program), &r.listing, &r.why,
                                                                 options.kernel_images.get(), tuning);
      else r.why = "no kernel generator for " + program->device.str();
    } catch (const std::exception& e) {
      r.why = e.what();  // e.g. NVRTC rejected the source: the group runs in ATen
      r.kernel.kernel = nullptr;
    }
  });

  std::unordered_map<int, GroupKernel> kernels;
  for (size_t i = 0; i < groups.size(); ++i) {
    if (listing) *listing += results[i].listing;
    if (results[i].kernel.kernel) kernels.emplace(groups[i], std::move(results[i].kernel));
    else if (declined) *declined += "group " + std::to_string(groups[i]) + ": " + results[i].why + "\n";
  }
  return kernels;
}

}  // namespace ember
