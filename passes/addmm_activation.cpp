// addmm_activation ("addmm_act")
//  1. On CUDA, relu(addmm(bias, a, b)) and gelu(addmm(bias, a, b), approximate="tanh") become one
//     aten::_addmm_activation(bias, a, b, use_gelu=...) when the addmm has beta = alpha = 1, a 1-D bias of
//     the result's width, f32/f16/bf16 operands, and no other use: cuBLASLt then applies bias and
//     activation as the GEMM's epilogue instead of a second kernel reading and writing the result.
//  2. ATen's op falls back to addmm + activation itself where cuBLASLt cannot, so the rewrite never
//     changes results beyond the library's rounding; erf-GELU (the default) has no Lt epilogue and stays.
//  3. The activation node is rewritten in place (its value keeps every use); the addmm is left for dead
//     code elimination.
#include "passes/passes.h"

#include "ember/epilogue.h"

#include <unordered_map>

namespace ember {
namespace {

bool gemm_dtype(c10::ScalarType t) { return t == c10::kFloat || t == c10::kHalf || t == c10::kBFloat16; }

const Arg* find_arg(const Node& n, size_t position, const char* name) {
  if (position < n.args.size()) return &n.args[position];
  for (const auto& [k, a] : n.kwargs)
    if (k == name) return &a;
  return nullptr;
}

// 0: not a fusible activation of its first input; 1: relu; 2: tanh-approximated gelu.
int activation_kind(const Node& n) {
  if (n.op == "aten::relu" && n.args.size() == 1 && n.kwargs.empty()) return 1;
  if (n.op != "aten::gelu") return 0;
  const Arg* a = find_arg(n, 1, "approximate");
  return a && a->kind == Arg::Kind::String && a->s == "tanh" ? 2 : 0;
}

}  // namespace

void fuse_addmm_activation(Graph& graph, PassContext&) {
  std::unordered_map<const Value*, int> uses;
  for (const auto& n : graph.nodes()) n->for_each_input([&](const Value* v) { ++uses[v]; });
  for (const Arg& a : graph.outputs()) a.for_each_value([&](const Value* v) { uses[v] += 2; });
  for (const auto& n : graph.nodes()) {
    int kind = activation_kind(*n);
    if (!kind || n->group >= 0 || !n->args[0].is_value()) continue;
    const Value* mm = n->args[0].value;
    const Node* addmm = mm->producer;
    const Value *src, *weights, *bias;
    if (!addmm || addmm->op != "aten::addmm" || addmm->group >= 0 || uses[mm] != 1 ||
        !as_matmul(*addmm, &src, &weights, &bias) || !bias)
      continue;
    const TensorType& out = mm->type.tensor;
    if (!mm->type.is_tensor() || !out.device.is_cuda() || !gemm_dtype(out.dtype) || out.sizes.size() != 2) continue;
    const TensorType& b = bias->type.tensor;
    if (b.sizes.size() != 1 || !(b.sizes[0] == out.sizes[1]) || b.dtype != out.dtype) continue;
    n->op = "aten::_addmm_activation";
    n->args = {Arg::of(const_cast<Value*>(bias)), Arg::of(const_cast<Value*>(src)), Arg::of(const_cast<Value*>(weights))};
    n->kwargs = {{"use_gelu", Arg::of_bool(kind == 2)}};
  }
}

}  // namespace ember
