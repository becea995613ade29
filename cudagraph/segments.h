// Splitting a Plan into the parts reduce-overhead mode captures and the parts it runs step by step.
// Pure analysis over the plan and its IR (no CUDA), so CI tests it on any machine.
#pragma once

#include "ember/runtime.h"

#include <string>
#include <vector>

namespace ember::cudagraph {

// A run of plan steps [first, last): captured into one CUDA graph, or run step by step every call.
struct Part {
  size_t first = 0, last = 0;
  bool captured = false;
  std::string why;  // for a part that is not captured: the reason of its first step

  // Captured parts only.
  std::vector<uint32_t> inputs;   // buffers read inside and defined before it (inputs, constants, earlier parts)
  std::vector<uint32_t> exports;  // buffers defined inside and read after it, or graph outputs
  std::vector<uint32_t> frees;    // buffers the part's steps release (applied after a replay)
};

struct Segmentation {
  std::vector<Part> parts;
  int device = -1;  // the CUDA device of the captured parts; -1: nothing to capture
  std::string why_none;  // set when no part is captured

  size_t captured_parts() const;
  // One line per part: "steps 0-11: captured ..." / "steps 12-12: eager: step 12 aten::nonzero: ...".
  std::string describe() const;
};

// Classifies every step and groups neighbours. A step is captured when all its tensors live on one CUDA
// device and it neither syncs with the host, nor makes a shape from data, nor is tagged cudagraph_unsafe,
// nor returns a host value, nor reads a host value computed at run time, nor writes in place into memory
// that is not the graph's own between calls (a graph input that is not pinned, a tensor made by an eager
// step). `pinned[i]`: graph input i keeps its address from call to call (parameters, buffers).
// Runs of captured steps without device work (shape arithmetic, views) are not captured.
Segmentation split_plan(const Plan& plan, const std::vector<bool>& pinned);

}  // namespace ember::cudagraph
