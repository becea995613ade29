// canonicalize
//  1. Removes copies that change nothing a consumer can see: aten::clone and aten::alias whose result has
//     the same dtype, device, sizes and strides as their input (AOTAutograd's functionalization leaves them
//     where eager dropout in eval mode returns its input, and around saved activations), a chain of
//     permutes and views that ends with its first value's type, and an aten::index.Tensor whose
//     indices are aranges over whole dimensions laid out as their outer product (index j varying along
//     dim j alone): it copies its input element for element. vmap writes a buffer read as bias[h, q, k]
//     (flex_attention's score_mod over all positions) so.
//  2. Keeps them whenever the graph writes any tensor in place (a later write could make the copy's
//     separate buffer observable), when the copy is a graph output, and when a clone or an index reaches a
//     graph output through views (the caller would get a tensor sharing memory with an input or another
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

// Views that keep the storage offset and only rename the elements' positions: a chain of them that ends where
// it started (same sizes and strides) is its first value.
bool offset_keeping_view(const Node& n) {
  return n.op == "aten::permute" || n.op == "aten::view" || n.op == "aten::_unsafe_view" || n.op == "aten::alias";
}

// The earliest value of a chain of such views ending in n's result with n's type: permute(permute(x, p), q)
// where q undoes p, and view(permute(view(permute(x)))), which the CPU's channels-last batch-norm and ReLU
// backwards (decompositions.py) make when one computes over [N*H*W, C] what the other hands on as [N, C, H, W].
const Value* undone_views(const Node& n) {
  if (!offset_keeping_view(n) || n.outputs.size() != 1) return nullptr;
  const Value* found = nullptr;
  for (const Value* v = first_value(n); v; v = v->producer && offset_keeping_view(*v->producer) ? first_value(*v->producer) : nullptr)
    if (same_type(v, n.outputs[0])) found = v;
  return found;
}

// Whether `v` is arange(0, n) (start 0, step 1), possibly through views (the caller's type check allows only
// those that add size-1 dims).
bool plain_arange(const Value* v, int64_t n) {
  while (v && v->producer && (v->producer->op == "aten::view" || v->producer->op == "aten::_unsafe_view" ||
                              v->producer->op == "aten::reshape" || v->producer->op == "aten::unsqueeze"))
    v = first_value(*v->producer);
  const Node* a = v ? v->producer : nullptr;
  if (!a) return false;
  auto is_int = [](const Arg* x, int64_t want) { return x && x->kind == Arg::Kind::Int && x->i == want; };
  if (a->op == "aten::arange") return is_int(a->arg(0, "end"), n);
  if (a->op != "aten::arange.start" && a->op != "aten::arange.start_step") return false;
  const Arg* step = a->op == "aten::arange.start_step" ? a->arg(2, "step") : nullptr;
  return is_int(a->arg(0, "start"), 0) && is_int(a->arg(1, "end"), n) && (!step || is_int(step, 1));
}

// index(x, [i0, .., im-1]) where index j is arange(0, x.size(j)) varying along dim j of their broadcast alone:
// the result is x's elements in x's order (the caller checks it has x's type).
const Value* identity_index(const Node& n) {
  if (n.op != "aten::index.Tensor" || n.args.size() < 2 || n.args[1].kind != Arg::Kind::List) return nullptr;
  const Value* x = first_value(n);
  if (!x || !x->type.is_tensor()) return nullptr;
  const std::vector<Dim>& sizes = x->type.tensor.sizes;
  const std::vector<Arg>& indices = n.args[1].list;
  const size_t m = indices.size();
  if (m == 0 || m > sizes.size()) return nullptr;
  for (size_t j = 0; j < m; ++j) {
    if (!indices[j].is_value() || !indices[j].value->type.is_tensor() || !sizes[j].is_constant()) return nullptr;
    const std::vector<Dim>& is = indices[j].value->type.tensor.sizes;
    if (is.size() > m) return nullptr;
    // Right-aligned against the m indexed dims, every size is 1 but the one at j. (An index none of whose dims
    // stands at j has one element, so the arange check below then holds only where sizes[j] is 1.)
    for (size_t d = 0; d < is.size(); ++d)
      if (!is[d].is_constant() || is[d].value != (m - is.size() + d == j ? sizes[j].value : 1)) return nullptr;
    if (!plain_arange(indices[j].value, sizes[j].value)) return nullptr;
  }
  return x;
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
    if ((n->op == "aten::clone" || n->op == "aten::index.Tensor") && seen_by_caller.count(n->outputs[0])) continue;
    const Value* source = is_plain_copy(*n) ? first_value(*n) : n->op == "aten::index.Tensor" ? identity_index(*n) : undone_views(*n);
    if (source && same_type(source, n->outputs[0])) replace.emplace_back(n->outputs[0], const_cast<Value*>(source));
  }
  graph.replace_uses(replace);
}

}  // namespace ember
