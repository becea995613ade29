// The entry points of ember/cudagraph.h. The capture runner itself (replay.cpp) needs ATen's CUDA
// headers and libraries and is built only against a CUDA torch (EMBER_WITH_CUDA_GRAPHS); every build has
// the plan analysis, so explain output and CI see the same segments a GPU machine captures.
#include "ember/cudagraph.h"

#include "cudagraph/runner.h"
#include "cudagraph/segments.h"

#include <atomic>

namespace ember {

namespace cudagraph {
std::atomic<uint64_t> step_generation{0};
}

bool cuda_graphs_supported() {
#ifdef EMBER_WITH_CUDA_GRAPHS
  return true;
#else
  return false;
#endif
}

std::string enable_cuda_graphs(CompiledGraph& graph, std::vector<bool> pinned, const CudaGraphOptions& options) {
  pinned.resize(graph.plan().num_inputs, false);
  cudagraph::Segmentation seg = cudagraph::split_plan(graph.plan(), pinned);
  if (seg.captured_parts() == 0) return "nothing to capture: " + seg.why_none;
#ifdef EMBER_WITH_CUDA_GRAPHS
  graph.set_runner(cudagraph::make_runner(graph, std::move(seg), std::move(pinned), options));
  return "";
#else
  (void)options;
  return "this ember was built against a torch without CUDA";
#endif
}

void mark_step_begin() { cudagraph::step_generation.fetch_add(1, std::memory_order_relaxed); }

}  // namespace ember
