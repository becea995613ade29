// addmm_activation ("addmm_act"): CUDA matmul epilogues that cuBLASLt applies inside the GEMM.
//  1. Bias: add(mm(a, b), bias) with a 1-D bias of the result's width becomes addmm(bias, a, b). A linear
//     on a 3-D input reaches the graph that way once fold_matmul has turned its batched product back into
//     one mm (nn.MultiheadAttention's input projection with batch_first=True).
//  2. Activation: relu(addmm(bias, a, b)) and gelu(addmm(bias, a, b), approximate="tanh") become one
//     aten::_addmm_activation(bias, a, b, use_gelu=...). ATen's op falls back to addmm + activation itself
//     where cuBLASLt cannot, so the rewrite never changes results beyond the library's rounding; erf-GELU
//     (the default) has no Lt epilogue and stays.
//  3. Bias into the next kernel: addmm(bias, a, b) whose result (through reshaping views) is read only by
//     ops the fuse pass puts in one kernel with it (pointwise ops of its shape, a layer norm) becomes
//     view(mm(a, b)) + bias, the add after the views, so the add joins that kernel and the GEMM runs without
//     epilogue (as inductor does). On the H100 cuBLASLt's biased picks were the slow ones on transformer
//     shapes (GPT-2 f32 b4 s128: 53 us for the biased projections where the plain ones take 35), and
//     kernels/cuda/gemm.cpp's timing can only add the bias back as an extra launch. A lone relu or tanh-gelu
//     keeps its cuBLASLt epilogue (2.).
//  4. All look through views that only reshape the contiguous product (a linear on a 3-D input: mm, then
//     view to [B, S, N]) and rewrite only where every intermediate has no other use, beta = alpha = 1, and
//     the operands are f32/f16/bf16 on CUDA. The rewritten op's result is viewed back to the shape the old
//     one had and takes over its uses; the old nodes are left for dead code elimination.
#include "passes/passes.h"

#include "ember/epilogue.h"
#include "ember/op_table.h"

#include <algorithm>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace ember {
namespace {

bool gemm_dtype(c10::ScalarType t) { return t == c10::kFloat || t == c10::kHalf || t == c10::kBFloat16; }

// 0: not a fusible activation of its first input; 1: relu; 2: tanh-approximated gelu.
int activation_kind(const Node& n) {
  if (n.op == "aten::relu" && n.args.size() == 1 && n.kwargs.empty()) return 1;
  if (n.op != "aten::gelu") return 0;
  const Arg* a = n.arg(1, "approximate");
  return a && a->kind == Arg::Kind::String && a->s == "tanh" ? 2 : 0;
}

class Rewriter {
 public:
  // Uses by dead nodes do not count: eval-mode dropout reaches the graph as a clone nobody reads, and it
  // would keep GPT-2's projections (addmm -> view -> clone, add) from every rewrite here.
  explicit Rewriter(Graph& graph) : graph_(graph) {
    const std::unordered_set<const Node*> dead = dead_nodes(graph);
    for (const auto& n : graph.nodes()) n->for_each_input([&](const Value* v) {
      if (dead.count(n.get())) return;
      ++uses_[v];
      readers_[v].push_back(n.get());
    });
    for (const Arg& a : graph.outputs()) a.for_each_value([&](const Value* v) { uses_[v] += 2; });
  }

  // The CUDA matmul behind `v` through single-use reshaping views, with its operands; null otherwise.
  const Node* matmul_behind(const Value* v, const Value** src, const Value** weights, const Value** bias) {
    while (v->producer && uses_[v] == 1 && (v->producer->op == "aten::view" || v->producer->op == "aten::_unsafe_view") &&
           !v->producer->args.empty() && v->producer->args[0].is_value() && v->producer->group < 0 &&
           row_major(v->type.tensor))
      v = v->producer->args[0].value;
    const Node* mm = v->producer;
    if (!mm || mm->group >= 0 || uses_[v] != 1 || !as_matmul(*mm, src, weights, bias)) return nullptr;
    const TensorType& out = v->type.tensor;
    if (!v->type.is_tensor() || !out.device.is_cuda() || !gemm_dtype(out.dtype) || out.sizes.size() != 2 ||
        !row_major(out))
      return nullptr;
    return mm;
  }

  // The shape argument of a view from `mm`'s result to `old`'s sizes, where `x` is what `node` read in its
  // place: constant sizes as a list of ints; symbolic ones as the list the view producing `x` was given
  // (its values are defined before `node`), where that view gave `old`'s sizes. Nothing where no view is
  // needed (the same sizes) or none can be written.
  static std::optional<Arg> view_shape(const Value* old, const Value* x, const Node* mm) {
    const std::vector<Dim>& sizes = old->type.tensor.sizes;
    if (sizes == mm->outputs[0]->type.tensor.sizes) return std::nullopt;
    if (std::all_of(sizes.begin(), sizes.end(), [](const Dim& d) { return d.is_constant(); })) {
      std::vector<Arg> shape;
      for (const Dim& d : sizes) shape.push_back(Arg::of_int(d.value));
      return Arg::of_list(std::move(shape));
    }
    const Node* view = x->producer;
    if (view && (view->op == "aten::view" || view->op == "aten::_unsafe_view") && view->args.size() == 2 &&
        x->type.tensor.sizes == sizes)
      return view->args[1];
    return std::nullopt;
  }

  // Whether `replace` can make `node` read the matmul's result in place of `x` (view_shape).
  static bool viewable(const Value* old, const Value* x, const Node* mm) {
    return old->type.tensor.sizes == mm->outputs[0]->type.tensor.sizes || view_shape(old, x, mm).has_value();
  }

  // Makes `node` (whose result is `old`, and which read `x`) op(args): in place where it has the matmul's
  // shape, else as op(args) with the matmul's result type viewed as `old` (same element count, contiguous;
  // view_shape), put before `node`, which then loses its uses.
  void replace(Node& node, const Value* old, const Value* x, const Node* mm, std::string op, std::vector<Arg> args,
               std::vector<std::pair<std::string, Arg>> kwargs) {
    const Value* product = mm->outputs[0];
    std::optional<Arg> shape = view_shape(old, x, mm);
    if (!shape) {
      node.op = std::move(op);
      node.args = std::move(args);
      node.kwargs = std::move(kwargs);
      return;
    }
    Value* fused = graph_.add_node(std::move(op), std::move(args), std::move(kwargs),
                                   {{old->name + "_gemm", product->type}})->outputs[0];
    Value* result = graph_.add_node("aten::view", {Arg::of(fused), std::move(*shape)}, {},
                                    {{old->name + "_view", old->type}})->outputs[0];
    graph_.move_last_before(2, &node);
    graph_.replace_uses({{old, result}});
  }

  // 1. add(view*(mm(a, b)), bias) -> view(addmm(bias, a, b)).
  bool bias(Node& n) {
    if (n.op != "aten::add.Tensor" || n.group >= 0 || n.outputs.size() != 1 || n.args.size() < 2 ||
        !n.args[0].is_value() || !n.args[1].is_value())
      return false;
    const Arg* alpha = n.arg(2, "alpha");
    if (alpha && !((alpha->kind == Arg::Kind::Int && alpha->i == 1) || (alpha->kind == Arg::Kind::Float && alpha->f == 1.0)))
      return false;
    const Value* out = n.outputs[0];
    if (!uses_[out] || !out->type.is_tensor() || !row_major(out->type.tensor)) return false;  // dead: rewritten before
    for (int side = 0; side < 2; ++side) {
      const Value* x = n.args[side].value;
      const Value* row = n.args[1 - side].value;
      const Value *src, *weights, *old_bias;
      const Node* mm = matmul_behind(x, &src, &weights, &old_bias);
      if (!mm || old_bias || !row->type.is_tensor()) continue;
      const TensorType& product = mm->outputs[0]->type.tensor;
      const TensorType& r = row->type.tensor;
      if (r.sizes.size() != 1 || !(r.sizes[0] == product.sizes[1]) || r.dtype != product.dtype ||
          out->type.tensor.dtype != product.dtype || !(element_count(out->type.tensor) == element_count(product)) || x == row ||
          !viewable(out, x, mm))
        continue;
      replace(n, out, x, mm, "aten::addmm",
              {Arg::of(const_cast<Value*>(row)), Arg::of(const_cast<Value*>(src)), Arg::of(const_cast<Value*>(weights))}, {});
      return true;
    }
    return false;
  }

  // 3. addmm(bias, a, b) -> view*(mm(a, b)) + bias where the readers fuse with the add.
  bool unfold_bias(Node& n) {
    if (n.op != "aten::addmm" || n.group >= 0 || n.outputs.size() != 1 || n.args.size() < 3) return false;
    for (int i = 0; i < 3; ++i)
      if (!n.args[i].is_value() || !n.args[i].value->type.is_tensor()) return false;
    for (size_t i = 3; i < n.args.size(); ++i)
      if (!(n.args[i].kind == Arg::Kind::Int && n.args[i].i == 1) && !(n.args[i].kind == Arg::Kind::Float && n.args[i].f == 1.0))
        return false;
    if (!n.kwargs.empty()) return false;
    Value* bias = n.args[0].value;
    const Value* product = n.outputs[0];
    const TensorType& out = product->type.tensor;
    const TensorType& b = bias->type.tensor;
    if (!out.device.is_cuda() || !gemm_dtype(out.dtype) || out.sizes.size() != 2 || !row_major(out) ||
        b.sizes.size() != 1 || !(b.sizes[0] == out.sizes[1]) || b.dtype != out.dtype || b.device != out.device)
      return false;
    // Through single-use views that keep the rows' width.
    Value* v = const_cast<Value*>(product);
    while (uses_[v] == 1 && readers_[v].size() == 1) {
      const Node* view = readers_[v][0];
      if ((view->op != "aten::view" && view->op != "aten::_unsafe_view") || view->group >= 0 || view->outputs.size() != 1)
        break;
      const TensorType& t = view->outputs[0]->type.tensor;
      if (!row_major(t) || t.sizes.empty() || !(t.sizes.back() == out.sizes[1])) break;
      v = view->outputs[0];
    }
    const std::vector<Node*>& readers = readers_[v];
    if (readers.empty() || uses_[v] != static_cast<int>(readers.size())) return false;  // a graph output
    for (const Node* r : readers)
      if (!fuses_with(*r, v)) return false;
    Node* first = nullptr;  // the earliest reader in graph order, dead ones included (their uses move too)
    for (const auto& node : graph_.nodes()) {
      node->for_each_input([&](const Value* in) {
        if (in == v && !first) first = node.get();
      });
      if (first) break;
    }
    n.op = "aten::mm";
    n.args = {n.args[1], n.args[2]};
    Node* add = graph_.add_node("aten::add.Tensor", {Arg::of(v), Arg::of(bias)}, {}, {{v->name + "_biased", v->type}});
    graph_.move_last_before(1, first);
    graph_.replace_uses({{v, add->outputs[0]}});
    add->args[0] = Arg::of(v);
    return true;
  }

  // Whether the fuse pass puts `reader` in one kernel with an add producing `v`: a pointwise op of v's
  // shape or a layer norm over its rows, on contiguous tensors, other than an activation cuBLASLt applies.
  static bool fuses_with(const Node& reader, const Value* v) {
    if (activation_kind(reader) || reader.outputs.empty() || !reader.outputs[0]->type.is_tensor()) return false;
    const OpInfo* info = nullptr;
    try {
      info = &op_info(reader.op);
    } catch (const std::exception&) {
      return false;
    }
    if (!info->has(kFusible) || !row_major(reader.outputs[0]->type.tensor)) return false;
    if (info->has(kReduction)) return reader.op == "aten::native_layer_norm" && reader.args[0].is_value() && reader.args[0].value == v;
    return reader.outputs[0]->type.tensor.sizes == v->type.tensor.sizes;
  }

  // 2. act(view*(addmm(bias, a, b))) -> view(_addmm_activation(bias, a, b)).
  bool activation(Node& n) {
    const int kind = activation_kind(n);
    if (!kind || n.group >= 0 || !n.args[0].is_value() || n.outputs.size() != 1) return false;
    const Value* out = n.outputs[0];
    const Value *src, *weights, *bias;
    const Node* addmm = matmul_behind(n.args[0].value, &src, &weights, &bias);
    if (!uses_[out] || !addmm || !bias || !out->type.is_tensor() || !row_major(out->type.tensor)) return false;
    const TensorType& product = addmm->outputs[0]->type.tensor;
    const TensorType& b = bias->type.tensor;
    if (b.sizes.size() != 1 || !(b.sizes[0] == product.sizes[1]) || b.dtype != product.dtype ||
        out->type.tensor.dtype != product.dtype || !viewable(out, n.args[0].value, addmm))
      return false;
    replace(n, out, n.args[0].value, addmm, "aten::_addmm_activation",
            {Arg::of(const_cast<Value*>(bias)), Arg::of(const_cast<Value*>(src)), Arg::of(const_cast<Value*>(weights))},
            {{"use_gelu", Arg::of_bool(kind == 2)}});
    return true;
  }

 private:
  Graph& graph_;
  std::unordered_map<const Value*, int> uses_;
  std::unordered_map<const Value*, std::vector<Node*>> readers_;  // each reading node once per read
};

}  // namespace

void fuse_addmm_activation(Graph& graph, PassContext&) {
  // Biases first, so that an activation after a bias added to an mm finds the addmm it became. A round counts
  // uses once and rewrites every node it can. The counts go stale as it rewrites, but only ever in the direction
  // that declines: a value a rewrite leaves keeps its old (higher) count, a value it makes has none. So what a
  // round declines because of that, the next round (counted afresh) takes. Recounting after every rewrite, as
  // this did before, made the pass quadratic in a model's depth (GPT-2's and BERT's graphs 11-18 ms on the
  // H200 host; the test's 96-layer stack 83.5 -> 9.7 ms on the 2-core host, the same graph out).
  for (int stage = 0; stage < 3; ++stage) {
    bool changed = true;
    while (changed) {
      changed = false;
      Rewriter rewriter(graph);
      std::vector<Node*> nodes;
      for (const auto& n : graph.nodes()) nodes.push_back(n.get());
      for (Node* n : nodes)
        changed |= stage == 0 ? rewriter.bias(*n) : stage == 1 ? rewriter.activation(*n) : rewriter.unfold_bias(*n);
    }
  }
}

}  // namespace ember
