// fold_batched_matmul
//  1. Rewrites bmm(A[B, M, K], expand(W[K, N] -> [B, K, N])) on the CPU, a batch of B small products
//     against one broadcast weight, as one mm over the folded batch: view(mm(view(A, [B*M, K]), W), [B, M, N])
//     (A made contiguous first when it is not). ATen's matmul folds only contiguous batches; a linear on a
//     transposed input (nn.MultiheadAttention with batch_first=True) reaches the graph as 64 products of
//     2 rows each, ten times slower on the CPU than the folded one (TransformerEncoderLayer 256/4, 2x64).
//  2. Only for constant shapes and a contiguous bmm result (the folded result has the same layout). The GPU
//     needs it as much: on the H100, nn.TransformerEncoderLayer(256, 8, batch_first=True) at 8x128 ran its
//     input projection as a bmm of 128 products of 8 rows in 79 us where the folded mm (as eager's linear
//     runs it, after the same copy) takes about 19 us.
// The replaced bmm and the expand chain are left for dead code elimination.
#include "passes/passes.h"

#include <string>
#include <unordered_map>
#include <vector>

namespace ember {
namespace {

bool constant_sizes(const TensorType& t) {
  for (const Dim& d : t.sizes)
    if (!d.is_constant()) return false;
  return true;
}

std::vector<int64_t> sizes_of(const TensorType& t) {
  std::vector<int64_t> out;
  for (const Dim& d : t.sizes) out.push_back(d.value);
  return out;
}

TensorType contiguous(c10::ScalarType dtype, c10::Device device, const std::vector<int64_t>& sizes) {
  TensorType t;
  t.dtype = dtype;
  t.device = device;
  int64_t stride = 1;
  t.sizes.resize(sizes.size());
  t.strides.resize(sizes.size());
  for (size_t i = sizes.size(); i-- > 0;) {
    t.sizes[i] = Dim::constant(sizes[i]);
    t.strides[i] = Dim::constant(stride);
    stride *= std::max<int64_t>(sizes[i], 1);
  }
  return t;
}

Arg int_list(const std::vector<int64_t>& v) {
  std::vector<Arg> items;
  for (int64_t x : v) items.push_back(Arg::of_int(x));
  return Arg::of_list(std::move(items));
}

// The 2-D weight broadcast over the batch: follows views of the batch operand back to an expand of a
// [K, N] (or [1, K, N]) tensor. Null when the operand is anything else.
const Value* broadcast_weight(const Value* b) {
  while (b && b->producer && (b->producer->op == "aten::view" || b->producer->op == "aten::_unsafe_view") &&
         !b->producer->args.empty() && b->producer->args[0].is_value() &&
         b->producer->args[0].value->type.tensor.sizes == b->type.tensor.sizes)
    b = b->producer->args[0].value;
  if (!b || !b->producer || b->producer->op != "aten::expand" || b->producer->args.empty() ||
      !b->producer->args[0].is_value())
    return nullptr;
  const Value* w = b->producer->args[0].value;
  if (!w->type.is_tensor() || !constant_sizes(w->type.tensor)) return nullptr;
  std::vector<int64_t> ws = sizes_of(w->type.tensor), bs = sizes_of(b->type.tensor);
  if (bs.size() != 3) return nullptr;
  bool two_d = ws.size() == 2 && ws[0] == bs[1] && ws[1] == bs[2];
  bool leading_one = ws.size() == 3 && ws[0] == 1 && ws[1] == bs[1] && ws[2] == bs[2];
  return two_d || leading_one ? w : nullptr;
}

}  // namespace

void fold_batched_matmul(Graph& graph, PassContext&) {
  std::vector<const Node*> candidates;
  for (const auto& n : graph.nodes())
    if (n->op == "aten::bmm" && n->args.size() == 2 && n->args[0].is_value() && n->args[1].is_value() &&
        n->outputs.size() == 1)
      candidates.push_back(n.get());
  int fresh = 0;
  std::vector<std::pair<const Value*, Value*>> replaced;
  for (const Node* bmm : candidates) {
    Value* a = bmm->args[0].value;
    const Value* out = bmm->outputs[0];
    if (!a->type.is_tensor() || !out->type.is_tensor()) continue;
    const TensorType& at = a->type.tensor;
    const TensorType& ot = out->type.tensor;
    if (!(ot.device.is_cpu() || ot.device.is_cuda()) || !constant_sizes(at) || !constant_sizes(ot) || at.sizes.size() != 3) continue;
    const Value* w = broadcast_weight(bmm->args[1].value);
    if (!w || w->type.tensor.dtype != at.dtype) continue;
    std::vector<int64_t> as = sizes_of(at), os = sizes_of(ot);
    if (ot != contiguous(ot.dtype, ot.device, os)) continue;
    int64_t batch = as[0], m = as[1], k = as[2], n = os[2];

    std::string base = out->name + "_fold" + (fresh++ ? std::to_string(fresh) : "");
    size_t added = 0;
    Value* rows = a;
    if (at != contiguous(at.dtype, at.device, as)) {
      rows = graph.add_node("aten::clone", {Arg::of(a)},
                            {{"memory_format", Arg::of_memory_format(c10::MemoryFormat::Contiguous)}},
                            {{base + "_a", Type::of_tensor(contiguous(at.dtype, at.device, as))}})
                 ->outputs[0];
      ++added;
    }
    Value* flat = graph.add_node("aten::view", {Arg::of(rows), int_list({batch * m, k})}, {},
                                 {{base + "_rows", Type::of_tensor(contiguous(at.dtype, at.device, {batch * m, k}))}})
                      ->outputs[0];
    ++added;
    Value* weight = const_cast<Value*>(w);
    if (w->type.tensor.sizes.size() == 3) {  // [1, K, N] -> [K, N], same strides for the last two dims
      TensorType wt = w->type.tensor;
      wt.sizes.erase(wt.sizes.begin());
      wt.strides.erase(wt.strides.begin());
      weight = graph.add_node("aten::view", {Arg::of(weight), int_list({k, n})}, {}, {{base + "_w", Type::of_tensor(wt)}})
                   ->outputs[0];
      ++added;
    }
    Value* mm = graph.add_node("aten::mm", {Arg::of(flat), Arg::of(weight)}, {},
                               {{base + "_mm", Type::of_tensor(contiguous(ot.dtype, ot.device, {batch * m, n}))}})
                    ->outputs[0];
    ++added;
    Value* result = graph.add_node("aten::view", {Arg::of(mm), int_list(os)}, {}, {{base, Type::of_tensor(ot)}})
                        ->outputs[0];
    ++added;
    graph.move_last_before(added, bmm);
    replaced.emplace_back(out, result);
  }
  graph.replace_uses(replaced);
}

}  // namespace ember
