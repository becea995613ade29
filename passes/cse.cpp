// eliminate_common_subexpressions
//  1. Two nodes with the same op and the same arguments become one; later uses read the first.
//  2. Random ops, ops that write, ops with no outputs and prim::constant are never merged.
//  3. A node that reads memory some op writes (anything in the alias class of a mutated value, views
//     included) is never merged: the two reads may see different data.
//  4. Two values that are both graph outputs are never merged: the caller gets distinct tensors and
//     may mutate one without touching the other.
#include "passes/passes.h"

#include "ember/op_table.h"

#include <unordered_map>

namespace ember {

namespace {

// Union-find over values: a view's outputs join the class of its inputs.
class AliasClasses {
 public:
  const Value* find(const Value* v) {
    auto it = parent_.find(v);
    if (it == parent_.end() || it->second == v) return v;
    return it->second = find(it->second);
  }
  void join(const Value* a, const Value* b) {
    a = find(a);
    b = find(b);
    if (a != b) parent_[a] = b;
  }

 private:
  std::unordered_map<const Value*, const Value*> parent_;
};

}  // namespace

void eliminate_common_subexpressions(Graph& graph, PassContext&) {
  AliasClasses aliases;
  std::vector<const Value*> written;
  for (const auto& n : graph.nodes()) {
    const OpInfo& info = op_info(n->op);
    if (info.has(kView))
      for (const Value* out : n->outputs)
        n->for_each_input([&](const Value* in) { aliases.join(out, in); });
    if (!info.has(kMutates)) continue;
    for (size_t i = 0; i < n->args.size(); ++i)
      if (info.writes(static_cast<int>(i), ""))
        n->args[i].for_each_value([&](const Value* in) { written.push_back(in); });
    for (const auto& [name, arg] : n->kwargs)
      if (info.writes(-1, name)) arg.for_each_value([&](const Value* in) { written.push_back(in); });
  }
  std::unordered_map<const Value*, bool> mutated_class;
  for (const Value* v : written) mutated_class[aliases.find(v)] = true;

  std::unordered_map<const Value*, bool> is_output;
  for (const Arg& a : graph.outputs()) a.for_each_value([&](const Value* v) { is_output[v] = true; });

  std::unordered_map<std::string, const Node*> seen;
  std::unordered_map<const Value*, Value*> replacement;
  std::vector<std::pair<const Value*, Value*>> replace;
  std::unordered_map<const Node*, bool> merged;
  for (const auto& n : graph.nodes()) {
    // Read through earlier merges first, so that chains of equal nodes collapse in one sweep.
    n->for_each_input([&](Value*& in) {
      auto r = replacement.find(in);
      if (r != replacement.end()) in = r->second;
    });
    const OpInfo& info = op_info(n->op);
    if (n->outputs.empty() || n->op == "prim::constant" || info.has(kRandom) || info.has(kMutates)) continue;
    bool reads_mutated = false;
    n->for_each_input([&](const Value* in) { reads_mutated = reads_mutated || mutated_class.count(aliases.find(in)); });
    if (reads_mutated) continue;
    auto [it, inserted] = seen.emplace(print_call(*n), n.get());
    if (inserted) continue;
    bool both_outputs = false;
    for (size_t i = 0; i < n->outputs.size(); ++i)
      both_outputs = both_outputs || (is_output.count(n->outputs[i]) && is_output.count(it->second->outputs[i]));
    if (both_outputs) continue;
    for (size_t i = 0; i < n->outputs.size(); ++i) {
      if (is_output.count(n->outputs[i])) is_output[it->second->outputs[i]] = true;
      replacement[n->outputs[i]] = it->second->outputs[i];
      replace.emplace_back(n->outputs[i], it->second->outputs[i]);
    }
    merged[n.get()] = true;
  }
  graph.replace_uses(replace);  // graph outputs
  graph.remove_nodes_if([&](const Node& n) { return merged.count(&n) > 0; });
}

}  // namespace ember
