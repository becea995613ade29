// linear_chain: consecutive small CUDA linear layers become one ember::linear_chain node.
//  1. What: aten::mm(a, b), aten::addmm(bias, a, b) and aten::_addmm_activation(bias, a, b, use_gelu) (what
//     addmm_act leaves of a linear layer and its ReLU or tanh-GELU) where each layer's result is read by
//     nothing but the next layer's GEMM, as its left operand. A chain of two or more becomes
//        ember::linear_chain(x, [b0, b1, ...], [bias0, None, ...], [act0, act1, ...])
//     with act 0 none, 1 ReLU, 2 tanh-GELU; the last layer's node becomes the chain (it keeps its result
//     and place) and the others are left for dce.
//  2. Why: such a model spends its time launching. 20 x Linear(100, 100) at batch 32 on the H100 host was
//     20 GEMM steps of 6.6 us host time each in the default mode (a launch and an output allocation), and
//     122 us of GPU time per call, mostly the gaps between 20 small kernels. kernels/cuda/linear_chain.cpp
//     runs the whole chain as one kernel whose thread blocks each take a few rows through every layer, the
//     activations in shared memory and the next layer's weights loading while this one multiplies: 18 us
//     of host time and 56 us of GPU time per call. (A CUDA graph replay's host time did not change with it,
//     10.0 against 10.7 us: that follows the graph's 41 inputs, not its nodes.)
//  3. Where it applies: f32/f16/bf16 on one CUDA device; static shapes; every layer's width and input
//     width at most kMaxWidth (the weights of a layer fit in shared memory); at most kMaxRows rows (each
//     thread block reads every weight, so many blocks would re-read them from L2 more often than the
//     separate GEMMs do); up to kMaxLayers layers per node (longer chains become several); left operand of
//     the first layer any strides, results contiguous; a bias only as a contiguous row of the layer's
//     width; beta = alpha = 1. Not in graphs that write any tensor in place (the chain reads every weight
//     where its last layer stood).
//  4. A softmax or log_softmax over the last layer's columns (aten::_softmax(y, -1 or 1, false), the only
//     reader of y) joins the chain as its epilogue, softmax=1 or 2, the kernel normalizing each row in
//     shared memory: a single GEMM with one becomes a chain of one layer (softmax(a @ b, -1) on 100x100:
//     one launch instead of ember's GEMM kernel and ATen's softmax).
//  5. The op has an ATen implementation (kernels/linear_chain_op.cpp: the same addmm / _addmm_activation /
//     mm calls in order), which runs wherever the kernel does not: a build without it, a GPU whose shared
//     memory is too small, operands of other sizes at run time.
#include "passes/passes.h"

#include "ember/op_table.h"

#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace ember {
namespace {

constexpr int64_t kMaxWidth = 128;
constexpr int64_t kMaxRows = 2048;
constexpr size_t kMaxLayers = 32;

struct Layer {
  Node* node;
  Value* a;     // left operand [M, K]
  Value* b;     // right operand [K, N]
  Value* bias;  // [N] or null
  int act;      // 0 none, 1 ReLU, 2 tanh-GELU
};

bool is_one(const Arg* a) {
  return !a || (a->kind == Arg::Kind::Int && a->i == 1) || (a->kind == Arg::Kind::Float && a->f == 1.0);
}

bool contiguous_2d(const TensorType& t) {
  return static_matrix(t) && (t.sizes[1].value == 1 || t.strides[1].value == 1) &&
         (t.sizes[0].value == 1 || t.strides[0].value == t.sizes[1].value);
}

Value* tensor_value(const Arg* a) {
  return a && a->is_value() && a->value->type.is_tensor() ? a->value : nullptr;
}

// `n` as one layer of a chain, or nothing.
std::optional<Layer> as_layer(Node& n) {
  Layer l{&n, nullptr, nullptr, nullptr, 0};
  if (n.outputs.size() != 1 || !n.outputs[0]->type.is_tensor()) return std::nullopt;
  if (n.op == "aten::mm") {
    if (n.args.size() != 2 || !n.kwargs.empty()) return std::nullopt;
    l.a = tensor_value(&n.args[0]), l.b = tensor_value(&n.args[1]);
  } else if (n.op == "aten::addmm" || n.op == "aten::_addmm_activation") {
    if (n.args.size() != 3 || !is_one(n.arg(3, "beta")) || !is_one(n.arg(4, "alpha"))) return std::nullopt;
    for (const auto& [k, v] : n.kwargs)
      if (k != "beta" && k != "alpha" && k != "use_gelu") return std::nullopt;
    l.bias = tensor_value(&n.args[0]), l.a = tensor_value(&n.args[1]), l.b = tensor_value(&n.args[2]);
    if (!l.bias) return std::nullopt;
    if (n.op == "aten::_addmm_activation") {
      const Arg* gelu = n.arg(5, "use_gelu");
      if (gelu && gelu->kind != Arg::Kind::Bool) return std::nullopt;
      l.act = gelu && gelu->b ? 2 : 1;
    }
  } else {
    return std::nullopt;
  }
  if (!l.a || !l.b) return std::nullopt;
  const TensorType& a = l.a->type.tensor;
  const TensorType& b = l.b->type.tensor;
  const TensorType& out = n.outputs[0]->type.tensor;
  const c10::ScalarType dtype = out.dtype;
  if (dtype != c10::kFloat && dtype != c10::kHalf && dtype != c10::kBFloat16) return std::nullopt;
  if (!out.device.is_cuda() || a.dtype != dtype || b.dtype != dtype || a.device != out.device || b.device != out.device)
    return std::nullopt;
  if (!static_matrix(a) || !static_matrix(b) || !contiguous_2d(out)) return std::nullopt;
  const int64_t m = a.sizes[0].value, k = a.sizes[1].value, width = b.sizes[1].value;
  if (b.sizes[0].value != k || out.sizes[0].value != m || out.sizes[1].value != width) return std::nullopt;
  if (m < 1 || m > kMaxRows || k < 1 || k > kMaxWidth || width < 1 || width > kMaxWidth) return std::nullopt;
  if (l.bias) {
    const TensorType& t = l.bias->type.tensor;
    if (t.dtype != dtype || t.device != out.device || t.sizes.size() != 1 || !(t.sizes[0] == Dim::constant(width)) ||
        !t.strides[0].is_constant() || (width > 1 && t.strides[0].value != 1))
      return std::nullopt;
  }
  return l;
}

}  // namespace

void fuse_linear_chains(Graph& graph, PassContext&) {
  const std::unordered_set<const Node*> dead = dead_nodes(graph);
  std::unordered_map<const Value*, int> uses;
  for (const auto& n : graph.nodes()) {
    if (op_info(n->op).has(kMutates)) return;  // see 3.
    if (dead.count(n.get())) continue;
    n->for_each_input([&](const Value* v) { ++uses[v]; });
  }
  for (const Arg& a : graph.outputs()) a.for_each_value([&](const Value* v) { uses[v] += 2; });

  // Chains in graph order; a layer extends the chain whose last layer made its left operand.
  std::vector<std::vector<Layer>> chains;
  std::unordered_map<const Value*, size_t> chain_ending_in;
  for (const auto& n : graph.nodes()) {
    if (dead.count(n.get())) continue;
    std::optional<Layer> layer = as_layer(*n);
    if (!layer) continue;
    auto it = chain_ending_in.find(layer->a);
    if (it != chain_ending_in.end() && uses[layer->a] == 1 && chains[it->second].size() < kMaxLayers) {
      const size_t c = it->second;
      chain_ending_in.erase(it);
      chains[c].push_back(*layer);
      chain_ending_in[n->outputs[0]] = c;
    } else {
      chains.push_back({*layer});
      chain_ending_in[n->outputs[0]] = chains.size() - 1;
    }
  }

  // 4.: the softmax reading a chain's result, if it is the only reader.
  std::unordered_map<const Value*, Node*> softmax_of;
  for (const auto& n : graph.nodes()) {
    if (dead.count(n.get()) || (n->op != "aten::_softmax" && n->op != "aten::_log_softmax") || n->args.size() != 3 ||
        !n->args[0].is_value() || n->args[1].kind != Arg::Kind::Int || n->args[2].kind != Arg::Kind::Bool ||
        n->args[2].b || n->outputs.size() != 1)
      continue;
    const Value* in = n->args[0].value;
    if ((n->args[1].i == -1 || n->args[1].i == 1) && uses[in] == 1 && chain_ending_in.count(in))
      softmax_of[in] = n.get();
  }

  for (const std::vector<Layer>& chain : chains) {
    auto softmax = softmax_of.find(chain.back().node->outputs[0]);
    if (chain.size() < 2 && softmax == softmax_of.end()) continue;
    std::vector<Arg> weights, biases, acts;
    for (const Layer& l : chain) {
      weights.push_back(Arg::of(l.b));
      biases.push_back(l.bias ? Arg::of(l.bias) : Arg::none());
      acts.push_back(Arg::of_int(l.act));
    }
    Node& last = softmax != softmax_of.end() ? *softmax->second : *chain.back().node;
    std::vector<Arg> args = {Arg::of(chain.front().a), Arg::of_list(std::move(weights)),
                             Arg::of_list(std::move(biases)), Arg::of_list(std::move(acts))};
    if (softmax != softmax_of.end()) args.push_back(Arg::of_int(last.op == "aten::_softmax" ? 1 : 2));
    last.op = "ember::linear_chain";
    last.args = std::move(args);
    last.kwargs.clear();
  }
}

}  // namespace ember
