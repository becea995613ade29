// fold_batchnorm
//  1. Rewrites an eval-mode batch norm (aten::_native_batch_norm_legit_no_training) that reads nothing but a
//     convolution's result as that convolution with folded weights and bias:
//        w' = w * gamma / sqrt(var + eps)   (per output channel)    b' = (b - mean) * gamma / sqrt(var + eps) + beta
//     computed (in float32) by one ember::fold_batchnorm node ahead of the convolution.
//  2. Only where the weights, bias, gamma, beta, mean and var are graph inputs or constants (parameters and
//     buffers), the convolution's result has no other use, the batch norm's saved statistics are unused, and
//     nothing in the graph writes in place: the folded tensors then change only when a parameter does, and the
//     fold node is cached per parameter generation (kernels/cpu/fold_batchnorm_kernel.cpp), so that the
//     convolution reads weights that stay put and packs them once, with a following ReLU as its post-op.
//  3. The fold node gets a group of its own (its kernel caches); without that kernel it still runs, uncached,
//     through the dispatcher op of the same name. The replaced convolution and batch norm are removed.
//  4. CPU: f32 convolutions (oneDNN takes a following ReLU as a post-op, passes/matmul_epilogue.cpp).
//  5. CUDA (f32, f16, bf16 2-D convolutions, cuDNN enabled): only where what follows the batch norm is a
//     ReLU, or an add of a same-shaped tensor and then a ReLU (a residual block's end), and only where the
//     parameters stay put between calls (constants, or inputs the runtime caches: CompileOptions::
//     cached_inputs, an inference graph's parameters and buffers, and copies of them such as layout.py's
//     channels_last weights). Convolution, batch norm, add and ReLU then become one cuDNN call with the
//     epilogue fused (aten::cudnn_convolution_relu / aten::cudnn_convolution_add_relu), instead of the
//     convolution writing its result and a fused kernel reading it back (H100, bf16, resnet50 b64 shapes:
//     the 53 batch-norm kernels took 1458 of 3395 us of GPU time per call; a 256->128 1x1 convolution over
//     56x56 took 60 us alone and 73 us with bias and ReLU fused). 16-bit folded weights are rounded once to
//     their dtype: the result differs from eager's (which rounds the convolution's result before the batch
//     norm) by about as much as eager's own rounding. Other CUDA batch norms stay for bn_pointwise.
//  6. Uses are counted over the nodes whose results something reads: canonicalize leaves the copies it bypasses
//     for dead code elimination, which runs after this pass, and such a dead clone of a convolution's result
//     kept its batch norm unfolded.
//  7. A clone between the convolution and the batch norm whose result has the convolution's type (sizes and
//     strides: a `.contiguous(memory_format=...)` that changes nothing, which canonicalize keeps) goes with them.
#include "passes/passes.h"

#include "ember/op_table.h"

#include <ATen/Context.h>

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

// A [channels] tensor (or None) of float32, or of `dtype` as well.
bool is_vector_of(const Arg& a, const Dim& channels, c10::ScalarType dtype = c10::kFloat) {
  if (a.kind == Arg::Kind::None) return true;
  const TensorType& t = a.value->type.tensor;
  return t.sizes.size() == 1 && t.sizes[0] == channels && (t.dtype == c10::kFloat || t.dtype == dtype);
}

bool is_list_of(const Arg& a, int64_t v) {
  if (a.kind != Arg::Kind::List) return false;
  for (const Arg& item : a.list)
    if (item.kind != Arg::Kind::Int || item.i != v) return false;
  return true;
}

// Values that are the same tensor on every call while the model is unchanged: constants, inputs the runtime
// caches (CompileOptions::cached_inputs), and what deterministic nodes make of nothing else.
class Staying {
 public:
  Staying(const Graph& graph, const std::vector<bool>& cached) {
    for (size_t i = 0; i < graph.inputs().size(); ++i) known_[graph.inputs()[i]] = i < cached.size() && cached[i];
  }
  bool operator()(const Value* v) {
    auto it = known_.find(v);
    if (it != known_.end()) return it->second;
    const Node* p = v->producer;
    bool stays = p != nullptr && !op_info(p->op).has(kRandom);
    known_[v] = stays;  // (a cycle cannot occur; this only guards the recursion)
    if (stays && p->op != "prim::constant") p->for_each_input([&](const Value* in) { stays = stays && (*this)(in); });
    known_[v] = stays;
    return stays;
  }

 private:
  std::unordered_map<const Value*, bool> known_;
};

// What a CUDA batch norm's result flows into, for one cuDNN call with the convolution (point 5): the
// ReLU that ends it and, for the residual form, the add and the tensor it adds. Null `relu` where none.
struct CudaEpilogue {
  const Node* add = nullptr;
  const Value* residual = nullptr;
  const Node* relu = nullptr;
};

CudaEpilogue cuda_epilogue(const Value* bn_out, const std::unordered_map<const Value*, std::vector<const Node*>>& readers) {
  auto only_reader = [&](const Value* v) -> const Node* {
    auto it = readers.find(v);
    return it != readers.end() && it->second.size() == 1 ? it->second[0] : nullptr;
  };
  CudaEpilogue e;
  const Node* next = only_reader(bn_out);
  if (!next) return e;
  if (next->op == "aten::add.Tensor" && next->args.size() == 2 && next->outputs.size() == 1) {
    for (const auto& kw : next->kwargs)
      if (kw.first != "alpha" || !((kw.second.kind == Arg::Kind::Int && kw.second.i == 1) ||
                                   (kw.second.kind == Arg::Kind::Float && kw.second.f == 1.0)))
        return e;
    const Arg& other = next->args[0].is_value() && next->args[0].value == bn_out ? next->args[1] : next->args[0];
    if (!other.is_value() || other.value == bn_out || !other.value->type.is_tensor()) return e;
    const TensorType &z = other.value->type.tensor, &y = bn_out->type.tensor;
    if (!(z.sizes == y.sizes) || z.dtype != y.dtype || z.device != y.device) return e;
    e.add = next;
    e.residual = other.value;
    next = only_reader(next->outputs[0]);
    if (!next) return {};
  }
  if (next->op != "aten::relu" || next->args.size() != 1 || next->outputs.size() != 1) return {};
  e.relu = next;
  return e;
}

// A clone (in any memory format) whose result has its input's type, of a value made by a node and read by nothing
// else (point 7).
bool layout_copy_of_one_use(const Node& n, std::unordered_map<const Value*, int>& uses) {
  if (n.op != "aten::clone" || n.args.size() != 1 || n.outputs.size() != 1 || !n.args[0].is_value()) return false;
  for (const auto& kw : n.kwargs)
    if (kw.first != "memory_format") return false;
  const Value* x = n.args[0].value;
  return x->producer && uses[x] == 1 && x->type.is_tensor() && n.outputs[0]->type.is_tensor() && x->type.tensor == n.outputs[0]->type.tensor;
}

}  // namespace

void fold_batchnorm(Graph& graph, PassContext& ctx) {
  const auto& nodes = graph.nodes();
  for (const auto& n : nodes)
    if (op_info(n->op).has(kMutates)) return;  // in-place writes below autograd move no version counter
  // Point 6: the nodes whose results something reads (the graph's outputs, through the nodes that make them).
  std::unordered_set<const Value*> read;
  for (const Arg& a : graph.outputs()) a.for_each_value([&](const Value* v) { read.insert(v); });
  std::unordered_set<const Node*> live;
  for (auto it = nodes.rbegin(); it != nodes.rend(); ++it) {
    bool used = (*it)->outputs.empty() || op_info((*it)->op).has(kRandom);  // (asserts, random state)
    for (const Value* v : (*it)->outputs) used = used || read.count(v) > 0;
    if (!used) continue;
    live.insert(it->get());
    (*it)->for_each_input([&](const Value* v) { read.insert(v); });
  }
  std::vector<const Node*> dead;
  std::unordered_map<const Value*, int> uses;
  std::unordered_map<const Value*, std::vector<const Node*>> readers;
  for (const auto& n : nodes) {
    if (!live.count(n.get())) {
      dead.push_back(n.get());
      continue;
    }
    n->for_each_input([&](const Value* v) {
      ++uses[v];
      readers[v].push_back(n.get());
    });
  }
  for (const Arg& a : graph.outputs())
    a.for_each_value([&](const Value* v) {
      uses[v] += 2;
      readers[v].push_back(nullptr);  // a graph output: no single reader
      readers[v].push_back(nullptr);
    });
  Staying stays(graph, ctx.options.cached_inputs);
  const bool cudnn = at::globalContext().userEnabledCuDNN();
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
    const Node* copy = layout_copy_of_one_use(*conv, uses) ? conv : nullptr;  // point 7
    if (copy) conv = copy->args[0].value->producer;
    if (conv->op != "aten::convolution" || conv->args.size() != 9 || !conv->kwargs.empty() ||
        conv->args[6].kind != Arg::Kind::Bool || conv->args[6].b || conv->group >= 0)
      continue;
    const TensorType& out = in.value->type.tensor;
    const bool cpu = out.device.is_cpu() && out.dtype == c10::kFloat && out.sizes.size() >= 3;
    // (CUDA: ungrouped, undilated convolutions only, the forms resnets use and the GPU tests cover; cuDNN's
    // fused engines were not tried on grouped or dilated ones.)
    const bool cuda = out.device.is_cuda() && cudnn && out.sizes.size() == 4 &&
                      (out.dtype == c10::kFloat || out.dtype == c10::kHalf || out.dtype == c10::kBFloat16) &&
                      is_list_of(conv->args[5], 1) && is_list_of(conv->args[7], 0) && conv->args[8].kind == Arg::Kind::Int &&
                      conv->args[8].i == 1;
    if (!cpu && !cuda) continue;
    // CPU: parameters as such (the fold kernel checks them per call); CUDA: values that stay put (point 5).
    auto parameter = [&](const Arg& a) { return cpu ? is_parameter(a) : a.kind == Arg::Kind::None || (a.is_value() && stays(a.value)); };
    const Arg &weights = conv->args[1], &bias = conv->args[2];
    if (!weights.is_value() || !parameter(weights) || !parameter(bias)) continue;
    const TensorType& wt = weights.value->type.tensor;
    const Dim channels = out.sizes[1];
    if (wt.dtype != out.dtype || wt.sizes.empty() || !(wt.sizes[0] == channels)) continue;
    bool params_ok = is_vector_of(bias, channels, out.dtype);
    for (size_t i = 1; i <= 4; ++i) params_ok = params_ok && parameter(bn->args[i]) && is_vector_of(bn->args[i], channels, out.dtype);
    if (!params_ok || bn->args[3].kind == Arg::Kind::None || bn->args[4].kind == Arg::Kind::None) continue;
    const Arg& eps = bn->args[6];
    if (eps.kind != Arg::Kind::Float && eps.kind != Arg::Kind::Int) continue;
    CudaEpilogue epilogue;
    if (cuda) {
      epilogue = cuda_epilogue(bn->outputs[0], readers);
      if (!epilogue.relu || removed.count(epilogue.relu) || (epilogue.add && removed.count(epilogue.add))) continue;
    }

    const std::string& base = bn->outputs[0]->name;
    TensorType bias_type;
    bias_type.dtype = out.dtype;  // ember::fold_batchnorm's bias comes in the weights' dtype
    bias_type.device = out.device;
    bias_type.sizes = {channels};
    bias_type.strides = {Dim::constant(1)};
    Node* fold = graph.add_node("ember::fold_batchnorm",
                                {weights, bias, bn->args[1], bn->args[2], bn->args[3], bn->args[4], eps}, {},
                                {{base + "_w", Type::of_tensor(wt)}, {base + "_b", Type::of_tensor(bias_type)}});
    fold->group = next_group++;
    if (cuda) {
      graph.move_last_before(1, bn);  // (the batch norm's parameters may be copies made after the convolution)
      // One cuDNN call where the ReLU was (after the residual, which may be computed after the convolution).
      std::vector<Arg> args = {conv->args[0], Arg::of(fold->outputs[0])};
      if (epilogue.add) {
        args.push_back(Arg::of(const_cast<Value*>(epilogue.residual)));
        args.push_back(Arg::of_float(1.0));
      }
      args.push_back(Arg::of(fold->outputs[1]));
      for (size_t i : {3, 4, 5, 8}) args.push_back(conv->args[i]);
      Value* relu_out = epilogue.relu->outputs[0];
      Node* fused = graph.add_node(epilogue.add ? "aten::cudnn_convolution_add_relu" : "aten::cudnn_convolution_relu",
                                   std::move(args), {}, {{base + "_conv_relu", relu_out->type}});
      graph.move_last_before(1, epilogue.relu);
      replaced.emplace_back(relu_out, fused->outputs[0]);
      for (const Node* n : {bn, conv, copy, epilogue.add, epilogue.relu})
        if (n) removed.insert(n);
      continue;
    }
    std::vector<Arg> conv_args = conv->args;
    conv_args[1] = Arg::of(fold->outputs[0]);
    conv_args[2] = Arg::of(fold->outputs[1]);
    Node* folded = graph.add_node("aten::convolution", std::move(conv_args), {},
                                  {{base + "_conv", bn->outputs[0]->type}});
    graph.move_last_before(2, conv);
    replaced.emplace_back(bn->outputs[0], folded->outputs[0]);
    removed.insert(bn);
    removed.insert(conv);
    if (copy) removed.insert(copy);
  }
  if (replaced.empty()) return;
  for (const Node* n : dead) removed.insert(n);  // they may read a removed convolution (point 6)
  graph.replace_uses(replaced);
  graph.remove_nodes_if([&](const Node& n) { return removed.count(&n) > 0; });
}

}  // namespace ember
