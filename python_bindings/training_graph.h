// A training graph's forward and backward as one C++ autograd function, in place of AOTAutograd's Python
// `CompiledFunction` (an autograd.Function whose forward and backward are Python frames around ember's
// plans). Per training step, measured in one process with the two alternating (H100 host, torch 2.11):
// the harness's MLP step 1085 -> 995 us and, in another run, 876 -> 794 us; BERT-base b8 19.20 -> 19.02 ms
// (its host time 15.03 -> 14.48 ms); resnet18 b8 8053 -> 7982 us (within that host's noise); on a 2-core
// CPU host, a 16-wide MLP step 278 -> 256 us (eager 208, Dynamo with no backend 248).
//
// backend.py builds a TrainingGraph only where AOTAutograd's wrapper would add nothing but that function
// (and the version bumps of inputs the graph writes in place, which DirectCall does): no input mutations
// left for the wrapper to replay, no aliased outputs, intermediate bases, effect tokens, symbolic values saved for the
// backward, functionalized RNG, tensor subclasses, autocast or inlined saved-tensor hooks. The forward's
// results are then the user outputs followed by the tensors saved for the backward (those with version
// checks, then those without), and the backward takes the saved tensors followed by one gradient per
// differentiable output.
#pragma once

#include "ember/runtime.h"

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace ember {

// How the backward expects a gradient laid out: AOTAutograd traced it with the forward output's sizes and
// strides, or, for overlapping or symbolic outputs, in a memory format. A gradient that arrives otherwise
// is copied into that layout first (as AOTAutograd's runtime does).
struct TangentLayout {
  int memory_format = -1;  // a c10::MemoryFormat; -1: `sizes` and `strides`
  std::vector<int64_t> sizes, strides;
};

struct TrainingGraph {
  std::shared_ptr<CompiledGraph> forward, backward;
  // One entry per user output (the forward's first results): whether it is differentiable.
  std::vector<bool> output_requires_grad;
  size_t saved_checked = 0;    // then this many saved tensors, checked for in-place changes at backward
  size_t saved_unchecked = 0;  // then these, not checked (eager does not check them either)
  std::vector<TangentLayout> tangents;  // one per differentiable output, in order
  // Inputs that get no edge in the autograd graph: non-leaf inputs whose gradient is statically none
  // (AOTAutograd detaches those).
  std::vector<bool> no_edge;
  // torch.use_deterministic_algorithms when AOTAutograd traced the graph: 0 or 1, -1 not recorded. A
  // backward traced with it off must not run with it on.
  int deterministic = -1;
};

// Called with the forward's results (run with grad mode off): returns the user outputs, the
// differentiable ones with an autograd node as grad_fn that holds the saved tensors and runs `backward`.
// Where grad mode is off or no input requires grad, the outputs come back as they are.
std::vector<c10::IValue> attach_backward(const std::shared_ptr<const TrainingGraph>& graph,
                                         const std::vector<c10::IValue>& inputs, std::vector<c10::IValue> results);

}  // namespace ember
