// The compile pipeline: IR in, a runnable CompiledGraph out. Passes are named and each can be
// switched off by name; with a debug directory set, the IR is written before and after each pass.
#pragma once

#include "ember/ir.h"
#include "ember/runtime.h"

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace ember {

namespace cuda {
class ImageStore;
}

struct CompileOptions {
  std::vector<std::string> disabled_passes;  // by name: "dce", "cse", ...
  std::string debug_dir;                     // empty: write nothing
  std::string graph_name = "graph";          // file prefix for debug dumps
  // CUDA kernel images: asked before NVRTC, told what NVRTC compiled (ember.export collects them into a
  // package; ember::load hands in the package's). Null: compile with NVRTC, keep nothing.
  std::shared_ptr<cuda::ImageStore> kernel_images;
  // Per graph input: whether the runtime caches the steps over it (the parameters of an inference graph,
  // CompiledGraph::cache_parameter_steps, which the caller applies after compiling). Passes may then move
  // work on those inputs into steps of their own (bn_pointwise: a batch norm's per-channel scale and shift).
  std::vector<bool> cached_inputs;
  // Per graph input: whether it may change without its version counter moving. A tensor subclass's inner
  // tensors do (a DTensor parameter's local shard: the optimizer's in-place step moves the DTensor's counter,
  // not the shard's), so nothing kept across calls may rest on theirs (packed matmul weights, EpilogueGroup).
  std::vector<bool> unversioned_inputs;
  // The subgraphs this graph's control flow nodes name (torch.cond's branches, a while_loop's condition and
  // body, a scan's combine function), each compiled before this graph, by the name the node gives.
  Subgraphs subgraphs;
  // mode="max-autotune": the steps that time their choices (CUDA GEMMs) try every candidate, until the graph
  // has spent `autotune_budget_s` seconds timing (runtime.h: Tuning).
  bool autotune = false;
  double autotune_budget_s = 30;
};

struct PassContext {
  const CompileOptions& options;
};

struct Pass {
  const char* name;
  void (*run)(Graph&, PassContext&);
};

// The default pipeline, in order.
const std::vector<Pass>& default_passes();

// Runs `passes` over `graph`, skipping disabled ones and dumping IR when asked. Returns the time
// each pass took, in milliseconds, in pipeline order.
std::vector<std::pair<std::string, double>> run_passes(Graph& graph, const std::vector<Pass>& passes,
                                                       PassContext& ctx);

// Parses nothing, owns nothing of the caller's: `constants` are the tensors prim::constant nodes name.
std::shared_ptr<CompiledGraph> compile(Graph graph, const std::unordered_map<std::string, at::Tensor>& constants,
                                       const CompileOptions& options);

}  // namespace ember
