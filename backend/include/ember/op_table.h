// The op table: for each op name in the IR, its traits and (for ATen ops) the dispatcher handle,
// resolved once at compile time and cached for the life of the process. Traits come from the op's
// schema and tags (pointwise, reduction, nondeterministic_seeded, ...) plus a short list of ember's
// own decisions (which ops stay extern, which sync with the host), so every pass reads one table.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace c10 {
class OperatorHandle;
}

namespace ember {

enum OpTrait : uint32_t {
  kPointwise = 1u << 0,
  kReduction = 1u << 1,
  kView = 1u << 2,         // an output aliases an input without writing it
  kRandom = 1u << 3,       // draws from a generator: never merged, never folded
  kMutates = 1u << 4,      // writes one of its inputs
  kExternOnly = 1u << 5,   // stays a library call (matmul, conv, attention)
  kCpuSync = 1u << 6,      // the host waits on the device (.item(), nonzero)
  kDynamicShape = 1u << 7, // output shape depends on data
  kCapturable = 1u << 8,   // may run inside a CUDA graph
  kPrim = 1u << 9,         // an ember primitive executed by the runtime itself
  kFusible = 1u << 10,     // ember's kernels implement it: pointwise, or a reduction over the last dim
  kCpuKeepAten = 1u << 11, // fusible, but on the CPU ATen's kernel (oneDNN JIT, MKL VML) is faster
  kSubgraphs = 1u << 12,   // control flow over compiled subgraphs (ember::cond, while_loop, scan): runs
                           // as its own kernel step (runtime/control_flow.cpp), never captured, never
                           // merged or folded (its branches may draw random numbers: kRandom too)
};

class Node;

struct OpInfo {
  std::string name;
  uint32_t traits = 0;
  const c10::OperatorHandle* handle = nullptr;  // null for prim ops
  // The arguments the op writes (schema `Tensor(a!)`), by position and by name.
  std::vector<std::pair<int, std::string>> written_args;
  // The schema's arguments, in order, and which of them have a default (empty for ember's own ops).
  std::vector<std::string> arg_names;
  std::vector<bool> arg_has_default;
  bool has(OpTrait t) const { return (traits & t) != 0; }
  bool writes(int position, const std::string& name) const {
    for (const auto& [p, n] : written_args)
      if (p == position || n == name) return true;
    return false;
  }
};

// Throws ember::Error naming the op when neither the dispatcher nor ember knows it.
const OpInfo& op_info(const std::string& name);

// Throws ember::Error where a node gives its dispatcher op more positional arguments than the schema has, a
// keyword it does not have or one twice, or leaves out an argument without a default. Passes read arguments by
// position; IR that fails this (a damaged package, a hand-written graph) never reaches them.
void check_arguments(const Node& n);

// Whether `name` is control flow over subgraphs (kSubgraphs: ember::cond, ember::while_loop, ember::scan).
bool is_control_flow(const std::string& name);

// Splits "aten::add.Tensor" into ("aten::add", "Tensor"); a missing overload is "".
std::pair<std::string, std::string> split_op_name(const std::string& name);

}  // namespace ember
