// canonicalize
//  1. Removes copies that change nothing a consumer can see: aten::clone and aten::alias whose result has
//     the same dtype, device, sizes and strides as their input (AOTAutograd's functionalization leaves them
//     where eager dropout in eval mode returns its input, and around saved activations), and a permute
//     of a permute that restores the original order with the same type.
//  2. Keeps them whenever the graph writes any tensor in place (a later write could make the copy's
//     separate buffer observable), when the copy is a graph output, and when a clone reaches a graph
//     output through views (the caller would get a tensor sharing memory with an input or another
//     output, where eager gave a fresh one).
// The removed nodes' uses read the original value; the nodes themselves are left for dead code elimination.
#include "passes/passes.h"

#include "ember/op_table.h"

#include <unordered_set>

namespace ember {
namespace {

bool same_type(const Value* a, const Value* b) { return a->type.is_tensor() && b->type.is_tensor() && a->type.tensor == b->type.tensor; }

const Value* first_value(const Node& n) { return !n.args.empty() && n.args[0].is_value() ? n.args[0].value : nullptr; }

// clone(x) with no memory format or preserve_format; alias(x).
bool is_plain_copy(const Node& n) {
  if (n.op == "aten::alias") return true;
  if (n.op != "aten::clone") return false;
  for (const auto& [k, a] : n.kwargs)
    if (k == "memory_format" && a.kind != Arg::Kind::None &&
        !(a.kind == Arg::Kind::MemoryFormat && a.i == static_cast<int64_t>(c10::MemoryFormat::Preserve)))
      return false;
  return n.args.size() < 2 || n.args[1].kind == Arg::Kind::None;
}

std::vector<int64_t> int_list(const Arg& a) {
  std::vector<int64_t> out;
  if (a.kind != Arg::Kind::List) return {};
  for (const Arg& i : a.list) {
    if (i.kind != Arg::Kind::Int) return {};
    out.push_back(i.i);
  }
  return out;
}

// permute(permute(x, p), q) == x when q undoes p.
const Value* undone_permute(const Node& n) {
  if (n.op != "aten::permute" || n.args.size() < 2) return nullptr;
  const Value* mid = first_value(n);
  if (!mid || !mid->producer || mid->producer->op != "aten::permute" || mid->producer->args.size() < 2) return nullptr;
  std::vector<int64_t> q = int_list(n.args[1]), p = int_list(mid->producer->args[1]);
  if (p.empty() || p.size() != q.size()) return nullptr;
  int64_t rank = static_cast<int64_t>(p.size());
  for (int64_t i = 0; i < rank; ++i) {
    int64_t qi = q[i] < 0 ? q[i] + rank : q[i];
    if (qi < 0 || qi >= rank) return nullptr;
    int64_t pi = p[qi] < 0 ? p[qi] + rank : p[qi];
    if (pi != i) return nullptr;
  }
  return first_value(*mid->producer);
}

}  // namespace

void canonicalize(Graph& graph, PassContext&) {
  for (const auto& n : graph.nodes())
    if (op_info(n->op).has(kMutates)) return;
  std::unordered_set<const Value*> outputs, seen_by_caller;  // graph outputs; values they are views of
  for (const Arg& a : graph.outputs()) a.for_each_value([&](const Value* v) { outputs.insert(v); });
  seen_by_caller = outputs;
  const auto& nodes = graph.nodes();
  for (auto it = nodes.rbegin(); it != nodes.rend(); ++it) {
    const Node& n = **it;
    bool reaches = false;
    for (const Value* v : n.outputs) reaches = reaches || seen_by_caller.count(v);
    if (reaches && op_info(n.op).has(kView)) n.for_each_input([&](const Value* v) { seen_by_caller.insert(v); });
  }
  std::vector<std::pair<const Value*, Value*>> replace;
  for (const auto& n : graph.nodes()) {
    if (n->outputs.size() != 1 || outputs.count(n->outputs[0])) continue;
    if (n->op == "aten::clone" && seen_by_caller.count(n->outputs[0])) continue;
    const Value* source = is_plain_copy(*n) ? first_value(*n) : undone_permute(*n);
    if (source && same_type(source, n->outputs[0])) replace.emplace_back(n->outputs[0], const_cast<Value*>(source));
  }
  graph.replace_uses(replace);
}

}  // namespace ember
