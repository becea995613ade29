// mode="reduce-overhead": a CompiledGraph's capturable parts recorded into CUDA graphs after warm-up and
// replayed on later calls (implementation and the ownership rules: cudagraph/).
#pragma once

#include "ember/runtime.h"

#include <string>
#include <vector>

namespace ember {

struct CudaGraphOptions {
  int warmup = 1;      // calls of each new input signature that run eagerly before it is captured
  int max_graphs = 8;  // input signatures recorded per compiled graph; beyond it calls run eagerly (one warning)
};

// True when this build can capture CUDA graphs (it was built against a torch with CUDA).
bool cuda_graphs_supported();

// Installs capture and replay on `graph`. pinned[i]: graph input i is expected at the same address on
// every call (parameters and buffers, which AOTAutograd reports as static): captured graphs use it in
// place. Every other tensor input is copied into a static buffer, unless it already lives in memory a
// captured graph owns (a forward's saved activations reaching the backward). Returns "" when installed,
// else why not (nothing runs on a CUDA device; a build without CUDA); the graph then runs as before.
std::string enable_cuda_graphs(CompiledGraph& graph, std::vector<bool> pinned, const CudaGraphOptions& options);

// torch.compiler.cudagraph_mark_step_begin(): outputs handed out before this call are dead to their
// holders, so replays may overwrite them without first copying them out.
void mark_step_begin();

}  // namespace ember
