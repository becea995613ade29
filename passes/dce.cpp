// eliminate_dead_code
//  1. Removes every node none of whose outputs reaches a graph output or a kept node.
//  2. Keeps nodes with effects: ops that write an input (copy_ for input mutations), ops with no
//     outputs (asserts), and host-syncing ops.
//  3. Random ops whose results are unused are removed: nothing observes the numbers they would draw.
#include "passes/passes.h"

#include "ember/op_table.h"

#include <unordered_set>

namespace ember {

namespace {
bool has_effects(const Node& n) {
  if (n.outputs.empty()) return true;
  const OpInfo& info = op_info(n.op);
  return info.has(kMutates) || info.has(kCpuSync);
}
}  // namespace

std::unordered_set<const Node*> dead_nodes(const Graph& graph) {
  std::unordered_set<const Value*> live;
  for (const Arg& a : graph.outputs()) a.for_each_value([&](const Value* v) { live.insert(v); });
  std::unordered_set<const Node*> dead;
  const auto& nodes = graph.nodes();
  for (auto it = nodes.rbegin(); it != nodes.rend(); ++it) {
    const Node& n = **it;
    bool used = has_effects(n);
    for (const Value* v : n.outputs) used = used || live.count(v);
    if (!used) {
      dead.insert(&n);
      continue;
    }
    n.for_each_input([&](const Value* v) { live.insert(v); });
  }
  return dead;
}

void eliminate_dead_code(Graph& graph, PassContext&) {
  const std::unordered_set<const Node*> dead = dead_nodes(graph);
  graph.remove_nodes_if([&](const Node& n) { return dead.count(&n) > 0; });
}

}  // namespace ember
