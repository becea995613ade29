// pad_matmul ("pad_mm"): 16-bit CUDA matmuls whose result rows are not a 16-byte multiple compute a
// padded result and hand out its leading columns, as inductor does for GPT-2's LM head.
//  1. Why: cuBLAS and cuBLASLt keep align-1 kernels for such a width. GPT-2's vocabulary of 50257 made the
//     bf16 LM head of b16 s512 (8192x50257x768) take 6.1 ms on the H100; with the weight's rows padded with
//     zeros to 50264 it takes 0.88 ms, plus 0.05 ms for the padding. Copying the padded result's leading
//     columns out to a contiguous result cost another 1.0 ms (kernels/cuda/gemm.cpp's padded route, which
//     stays for results read inside the graph); here the result is a strided view instead: [M, N] with row
//     stride N_pad, read by nothing but reshaping views on their way out of the graph.
//  2. Rewrites mm(a, b), b a [K, N] operand whose columns or rows are contiguous, to
//        mm(a, pad(b)) -> [M, N_pad]   then   slice(.., 1, 0, N) -> [M, N] with strides (N_pad, 1)
//     where pad(b) is aten::constant_pad_nd of b (through a transpose when b is a transposed [N, K] weight).
//     The reshaping views between the product and the graph's outputs get their strides recomputed; the old
//     mm is left to dead code elimination.
//  3. Only f16/bf16 on CUDA with static sizes, at least 2^26 multiply-adds (below that the padding's
//     launches outweigh what they save), and only where every use of the product is such a view chain to
//     graph outputs: an op computing from the strided view would have been typed for a contiguous one.
//     Outputs then differ from eager's in strides only (the row stride), as inductor's do.
#include "passes/passes.h"

#include <optional>
#include <unordered_map>
#include <vector>

namespace ember {
namespace {

bool is_reshape(const Node& n) {
  return (n.op == "aten::view" || n.op == "aten::_unsafe_view") && n.outputs.size() == 1 && n.args.size() >= 1 &&
         n.args[0].is_value() && n.group < 0;
}

TensorType with(const TensorType& like, std::vector<int64_t> sizes, std::vector<int64_t> strides) {
  TensorType t = like;
  t.sizes.clear();
  t.strides.clear();
  for (int64_t s : sizes) t.sizes.push_back(Dim::constant(s));
  for (int64_t s : strides) t.strides.push_back(Dim::constant(s));
  return t;
}

class Padder {
 public:
  explicit Padder(Graph& graph) : graph_(graph) {
    for (const auto& n : graph.nodes()) n->for_each_input([&](const Value* v) { readers_[v].push_back(n.get()); });
    for (const Arg& a : graph.outputs()) a.for_each_value([&](const Value* v) { ++returned_[v]; });
  }

  bool rewrite(Node& n) {
    if (n.op != "aten::mm" || n.group >= 0 || n.args.size() != 2 || !n.kwargs.empty() || n.outputs.size() != 1 ||
        !n.args[0].is_value() || !n.args[1].is_value())
      return false;
    Value* a = n.args[0].value;
    Value* b = n.args[1].value;
    Value* product = n.outputs[0];
    if (!a->type.is_tensor() || !b->type.is_tensor() || !product->type.is_tensor()) return false;
    const TensorType& out = product->type.tensor;
    const TensorType& bt = b->type.tensor;
    if (!static_matrix(out) || !static_matrix(bt) || !static_matrix(a->type.tensor) || !out.device.is_cuda() ||
        (out.dtype != c10::kHalf && out.dtype != c10::kBFloat16) || bt.dtype != out.dtype)
      return false;
    const int64_t m = out.sizes[0].value, n_cols = out.sizes[1].value, k = bt.sizes[0].value;
    const int64_t per = 16 / static_cast<int64_t>(c10::elementSize(out.dtype));
    const int64_t padded = (n_cols + per - 1) / per * per;
    if (padded == n_cols || out.strides[0].value != n_cols || out.strides[1].value != 1 ||
        double(m) * double(n_cols) * double(k) < double(int64_t{1} << 26))
      return false;
    const bool weight = bt.strides[0].value == 1 && bt.strides[1].value == k;    // a transposed [N, K]
    const bool row_major = bt.strides[1].value == 1 && bt.strides[0].value == n_cols;  // [K, N] itself
    if (!weight && !row_major) return false;
    std::vector<Node*> chain;  // reshaping views from the product to the graph's outputs
    if (!views_to_outputs(product, n_cols, &chain)) return false;

    const std::string& name = product->name;
    size_t added = 0;
    Value* padded_b;
    auto list = [](std::vector<int64_t> items) {
      std::vector<Arg> args;
      for (int64_t i : items) args.push_back(Arg::of_int(i));
      return Arg::of_list(std::move(args));
    };
    if (weight) {
      Node* rows = graph_.add_node("aten::permute", {Arg::of(b), list({1, 0})}, {},
                                   {{name + "_w", Type::of_tensor(with(bt, {n_cols, k}, {k, 1}))}});
      Node* pad = graph_.add_node("aten::constant_pad_nd", {Arg::of(rows->outputs[0]), list({0, 0, 0, padded - n_cols}), Arg::of_float(0.0)}, {},
                                  {{name + "_wpad", Type::of_tensor(with(bt, {padded, k}, {k, 1}))}});
      Node* back = graph_.add_node("aten::permute", {Arg::of(pad->outputs[0]), list({1, 0})}, {},
                                   {{name + "_wpad_t", Type::of_tensor(with(bt, {k, padded}, {1, k}))}});
      padded_b = back->outputs[0];
      added = 3;
    } else {
      Node* pad = graph_.add_node("aten::constant_pad_nd", {Arg::of(b), list({0, padded - n_cols}), Arg::of_float(0.0)}, {},
                                  {{name + "_bpad", Type::of_tensor(with(bt, {k, padded}, {padded, 1}))}});
      padded_b = pad->outputs[0];
      added = 1;
    }
    Node* wide = graph_.add_node("aten::mm", {Arg::of(a), Arg::of(padded_b)}, {},
                                 {{name + "_padded", Type::of_tensor(with(out, {m, padded}, {padded, 1}))}});
    Node* slice = graph_.add_node("aten::slice.Tensor", {Arg::of(wide->outputs[0]), Arg::of_int(1), Arg::of_int(0), Arg::of_int(n_cols), Arg::of_int(1)}, {},
                                  {{name + "_cols", Type::of_tensor(with(out, {m, n_cols}, {padded, 1}))}});
    graph_.move_last_before(added + 2, &n);
    graph_.replace_uses({{product, slice->outputs[0]}});
    // The views keep their sizes; their rows now lie N_pad apart.
    for (Node* view : chain) {
      TensorType& t = view->outputs[0]->type.tensor;
      int64_t stride = padded;
      for (size_t d = t.sizes.size(); d-- > 0;) {
        if (d + 1 == t.sizes.size()) {
          t.strides[d] = Dim::constant(1);
          continue;
        }
        t.strides[d] = Dim::constant(stride);
        stride *= t.sizes[d].value;
      }
    }
    return true;
  }

 private:
  // Whether every use of `v` is a reshaping view keeping rows of `width` (each with static sizes) whose
  // result in turn is used only so, ending in graph outputs; the views go to *chain.
  bool views_to_outputs(const Value* v, int64_t width, std::vector<Node*>* chain) {
    for (Node* r : readers_[v]) {
      if (!is_reshape(*r) || r->args[0].value != v) return false;
      const TensorType& t = r->outputs[0]->type.tensor;
      if (t.sizes.empty() || t.sizes.size() != t.strides.size()) return false;
      for (const Dim& d : t.sizes)
        if (!d.is_constant()) return false;
      if (t.sizes.back().value != width) return false;
      chain->push_back(r);
      if (!views_to_outputs(r->outputs[0], width, chain)) return false;
    }
    return !readers_[v].empty() || returned_[v] > 0;
  }

  Graph& graph_;
  std::unordered_map<const Value*, std::vector<Node*>> readers_;
  std::unordered_map<const Value*, int> returned_;
};

}  // namespace

void pad_matmul(Graph& graph, PassContext&) {
  std::vector<Node*> matmuls;
  for (const auto& n : graph.nodes())
    if (n->op == "aten::mm") matmuls.push_back(n.get());
  std::optional<Padder> padder;
  for (Node* n : matmuls) {
    if (!padder) padder.emplace(graph);
    if (padder->rewrite(*n)) padder.reset();  // the readers changed
  }
}

}  // namespace ember
