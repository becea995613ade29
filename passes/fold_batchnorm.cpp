// fold_batchnorm
//  1. Rewrites an eval-mode batch norm (aten::_native_batch_norm_legit_no_training) that reads nothing but a
//     CPU f32 convolution's result as that convolution with folded weights and bias:
//        w' = w * gamma / sqrt(var + eps)   (per output channel)    b' = (b - mean) * gamma / sqrt(var + eps) + beta
//     computed by one ember::fold_batchnorm node ahead of the convolution.
//  2. Only where the weights, bias, gamma, beta, mean and var are graph inputs or constants (parameters and
//     buffers), the convolution's result has no other use, the batch norm's saved statistics are unused, and
//     nothing in the graph writes in place: the folded tensors then change only when a parameter does, and the
//     fold node is cached per parameter generation (kernels/cpu/fold_batchnorm_kernel.cpp), so that the
//     convolution reads weights that stay put and packs them once, with a following ReLU as its post-op.
//  3. The fold node gets a group of its own (its kernel caches); without that kernel it still runs, uncached,
//     through the dispatcher op of the same name. The replaced convolution and batch norm are removed.
#include "passes/passes.h"

#include "ember/op_table.h"

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

namespace ember {
namespace {

// A parameter, a buffer or a constant: the same tensor on every call while the model is unchanged.
bool is_parameter(const Arg& a) {
  if (a.kind == Arg::Kind::None) return true;
  if (!a.is_value() || !a.value->type.is_tensor()) return false;
  const Node* p = a.value->producer;
  return p == nullptr || p->op == "prim::constant";
}

bool is_vector_of(const Arg& a, const Dim& channels) {
  if (a.kind == Arg::Kind::None) return true;
  const TensorType& t = a.value->type.tensor;
  return t.sizes.size() == 1 && t.sizes[0] == channels && t.dtype == c10::kFloat;
}

}  // namespace

void fold_batchnorm(Graph& graph, PassContext&) {
  const auto& nodes = graph.nodes();
  for (const auto& n : nodes)
    if (op_info(n->op).has(kMutates)) return;  // in-place writes below autograd move no version counter
  std::unordered_map<const Value*, int> uses;
  for (const auto& n : nodes) n->for_each_input([&](const Value* v) { ++uses[v]; });
  for (const Arg& a : graph.outputs()) a.for_each_value([&](const Value* v) { uses[v] += 2; });
  int next_group = 0;
  for (const auto& n : nodes) next_group = std::max(next_group, n->group + 1);

  std::vector<const Node*> batch_norms;
  for (const auto& n : nodes)
    if (n->op == "aten::_native_batch_norm_legit_no_training" && n->args.size() == 7 && n->kwargs.empty() &&
        n->outputs.size() == 3)
      batch_norms.push_back(n.get());

  std::vector<std::pair<const Value*, Value*>> replaced;
  std::unordered_set<const Node*> removed;
  for (const Node* bn : batch_norms) {
    const Arg& in = bn->args[0];
    if (!in.is_value() || !in.value->producer || uses[in.value] != 1) continue;
    if (uses[bn->outputs[1]] != 0 || uses[bn->outputs[2]] != 0) continue;
    const Node* conv = in.value->producer;
    if (conv->op != "aten::convolution" || conv->args.size() != 9 || !conv->kwargs.empty() ||
        conv->args[6].kind != Arg::Kind::Bool || conv->args[6].b || conv->group >= 0)
      continue;
    const TensorType& out = in.value->type.tensor;
    if (!out.device.is_cpu() || out.dtype != c10::kFloat || out.sizes.size() < 3) continue;
    const Arg &weights = conv->args[1], &bias = conv->args[2];
    if (!weights.is_value() || !is_parameter(weights) || !is_parameter(bias)) continue;
    const TensorType& wt = weights.value->type.tensor;
    const Dim channels = out.sizes[1];
    if (wt.dtype != c10::kFloat || wt.sizes.empty() || !(wt.sizes[0] == channels)) continue;
    bool params_ok = is_vector_of(bias, channels);
    for (size_t i = 1; i <= 4; ++i) params_ok = params_ok && is_parameter(bn->args[i]) && is_vector_of(bn->args[i], channels);
    if (!params_ok || bn->args[3].kind == Arg::Kind::None || bn->args[4].kind == Arg::Kind::None) continue;
    const Arg& eps = bn->args[6];
    if (eps.kind != Arg::Kind::Float && eps.kind != Arg::Kind::Int) continue;

    const std::string& base = bn->outputs[0]->name;
    TensorType bias_type;
    bias_type.dtype = c10::kFloat;
    bias_type.device = out.device;
    bias_type.sizes = {channels};
    bias_type.strides = {Dim::constant(1)};
    Node* fold = graph.add_node("ember::fold_batchnorm",
                                {weights, bias, bn->args[1], bn->args[2], bn->args[3], bn->args[4], eps}, {},
                                {{base + "_w", Type::of_tensor(wt)}, {base + "_b", Type::of_tensor(bias_type)}});
    fold->group = next_group++;
    std::vector<Arg> conv_args = conv->args;
    conv_args[1] = Arg::of(fold->outputs[0]);
    conv_args[2] = Arg::of(fold->outputs[1]);
    Node* folded = graph.add_node("aten::convolution", std::move(conv_args), {},
                                  {{base + "_conv", bn->outputs[0]->type}});
    graph.move_last_before(2, conv);
    replaced.emplace_back(bn->outputs[0], folded->outputs[0]);
    removed.insert(bn);
    removed.insert(conv);
  }
  if (replaced.empty()) return;
  graph.replace_uses(replaced);
  graph.remove_nodes_if([&](const Node& n) { return removed.count(&n) > 0; });
}

}  // namespace ember
