// The capture/replay runner (replay.cpp, CUDA builds only).
#pragma once

#include "cudagraph/segments.h"
#include "ember/cudagraph.h"

#include <atomic>
#include <memory>

namespace ember::cudagraph {

// Counts torch.compiler.cudagraph_mark_step_begin() calls.
extern std::atomic<uint64_t> step_generation;

std::unique_ptr<PlanRunner> make_runner(const CompiledGraph& graph, Segmentation seg, std::vector<bool> pinned,
                                        const CudaGraphOptions& options);

}  // namespace ember::cudagraph
