// claim_matmul_epilogues ("epilogue")
//  1. Each CPU aten::mm / aten::addmm (beta = alpha = 1) on 2-D f32/bf16 tensors, and each 2-D aten::convolution
//     (not transposed; its epilogue without views or broadcast rows), becomes one group with the
//     chain of ops that consume its result one after another and that a library matmul applies before it
//     writes (ember/epilogue.h): relu (clamp_min 0), gelu, silu, sigmoid, tanh, scaling and shifting by
//     constants, adding a residual or a broadcast row, and views of the [M, N] result.
//  2. A link joins only if the value it reads has no other use and is no graph output (the group writes
//     only its last value), keeps the dtype and the shape (an added tensor broadcasts into the result, never
//     the other way), and reads nothing made after the matmul (the group runs where the matmul stands).
//  3. A matmul with no epilogue is claimed only when its weights are a graph input or a view of one: what
//     it gains then is the weights packed once into the library's layout. In an inference graph whose
//     parameters are known (CompileOptions::cached_inputs), only a parameter counts: an input the caller
//     passes (softmax(a @ b)'s b) may change every call, and oneDNN then only adds its call overhead (2-core
//     AVX-512 host, 100x100 @ 100x100 + softmax, interleaved medians: 59.4 us through oneDNN, 54.1 through
//     ATen's mm, 33.1 eager). Where the parameters are not known (training graphs: a backward reads the
//     forward's activations as inputs, new at every call), a lone matmul stays ATen's too
//     (EMBER_TRAINING_MATMULS=onednn claims it, for measuring).
//  4. Runs before fuse, which leaves claimed nodes alone. The marks are advice, as fuse's are: a generator
//     that declines a group (no oneDNN, a GPU) leaves its nodes to ATen, unchanged.
//  5. Convolutions go to torch's own oneDNN convolution with post-ops (mkldnn::_convolution_pointwise, the
//     call inductor's CPU backend makes; kernels/cpu/conv_kernel.cpp) where this torch has it: their chain
//     stops at what that call applies (torch_conv_takes). EMBER_CPU_CONV=aten leaves them to ATen (for
//     measuring). With EMBER_ONEDNN_CONV=1 they go to ember's oneDNN instead, with any epilogue; not the
//     default, as ATen's convolution (torch's bundled, newer oneDNN) beat Debian's oneDNN 2.6 with fused
//     post-ops: torchvision resnet18 b8 on the GPU machine's 16 cores ran 30.1 ms through ember's oneDNN
//     convolutions against eager's 19.2 ms, and on a 2-core machine seven conv-bn-relu blocks ran 42.1 ms
//     through ATen against 46.9 ms (best of 60).
#include "passes/passes.h"

#include "ember/config.h"
#include "ember/epilogue.h"

#include <ATen/Context.h>

#include <cstdlib>
#include <cstring>

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

namespace ember {
namespace {


// Read at each compile, as EMBER_ONEDNN_CONV.
bool torch_convolutions() {
  return !config_is("EMBER_CPU_CONV", "aten") && at::hasMKLDNN();
}

// EMBER_TRAINING_MATMULS=onednn claims them anyway (for measuring).
bool lone_training_matmuls() {
  return config_is("EMBER_TRAINING_MATMULS", "onednn");
}

bool supported_dtype(c10::ScalarType t) { return t == c10::kFloat || t == c10::kBFloat16; }

// [N], or [1, ..., 1, N]: one row broadcast over the result.
bool is_row_of(const TensorType& t, const Dim& n) {
  if (t.sizes.empty() || !(t.sizes.back() == n)) return false;
  for (size_t i = 0; i + 1 < t.sizes.size(); ++i)
    if (!(t.sizes[i].is_constant() && t.sizes[i].value == 1)) return false;
  return true;
}

class Claimer {
 public:
  Claimer(Graph& g, const std::vector<bool>& cached) : graph_(g) {
    inference_ = cached.size() == g.inputs().size();
    if (!inference_) return;  // not an inference graph with its parameters known
    for (size_t i = 0; i < cached.size(); ++i)
      if (!cached[i]) passed_.insert(g.inputs()[i]);
  }

  void run() {
    const auto& nodes = graph_.nodes();
    for (size_t i = 0; i < nodes.size(); ++i) {
      Node& n = *nodes[i];
      for (const Value* v : n.outputs) position_[v] = i;
      n.for_each_input([&](const Value* v) {
        ++uses_[v];
        user_[v] = &n;
      });
    }
    for (const Arg& a : graph_.outputs()) a.for_each_value([&](const Value* v) { uses_[v] += 2; });
    int next = 0;  // after the groups earlier passes made (fold_batchnorm's)
    for (const auto& n : nodes) next = std::max(next, n->group + 1);
    for (size_t i = 0; i < nodes.size(); ++i) {
      Node& n = *nodes[i];
      if (n.group >= 0 || !claimable_matmul(n)) continue;
      std::vector<Node*> members = chain(n, i);
      const Value *src, *weights, *bias;
      if (!as_matmul(n, &src, &weights, &bias)) as_conv2d(n, &src, &weights, &bias);
      if (members.size() == 1) {
        const Value* input = input_behind(weights);
        if (!input || passed_.count(input)) continue;
        // Outside inference graphs whose parameters are known, a graph input is as likely an activation (a
        // backward reads the forward's as inputs), new at every call: never packed, and oneDNN on plain
        // operands lost to ATen's mm (LLaMA's training step on the 2-core host: backward 26-28 ms against
        // 21-22 with these matmuls left to ATen, eager's 19-21).
        if (n.op != "aten::convolution" && !inference_ && !lone_training_matmuls()) continue;
        // A lone convolution gains from torch's call only by packed weights, which need parameters that
        // stay (inference). resnet18's b2 training step, 2-core host: 1.12-1.13x over eager with its
        // convolutions through ATen, 1.06-1.07x through torch's call unpacked.
        if (n.op == "aten::convolution" && !onednn_convolutions_requested() && !inference_) continue;
      }
      for (Node* m : members) m->group = next;
      ++next;
    }
  }

 private:
  bool claimable_matmul(const Node& n) const {
    const Value *src, *weights, *bias;
    bool conv = as_conv2d(n, &src, &weights, &bias);
    if (conv && !onednn_convolutions_requested() && !torch_convolutions()) return false;
    if (!conv && !as_matmul(n, &src, &weights, &bias)) return false;
    const TensorType& out = n.outputs[0]->type.tensor;
    if (!n.outputs[0]->type.is_tensor() || !out.device.is_cpu() || !supported_dtype(out.dtype) ||
        out.sizes.size() != (conv ? 4u : 2u))
      return false;
    for (const Value* v : {src, weights, bias}) {
      if (!v) continue;
      if (v->type.tensor.dtype != out.dtype || !v->type.tensor.device.is_cpu()) return false;
    }
    if (!conv && (src->type.tensor.sizes.size() != 2 || weights->type.tensor.sizes.size() != 2)) return false;
    return !bias || (bias->type.tensor.sizes.size() == 1 && bias->type.tensor.sizes[0] == out.sizes[1]);
  }

  std::vector<Node*> chain(Node& matmul, size_t index) {
    std::vector<Node*> members = {&matmul};
    const Value* v = matmul.outputs[0];
    const TensorType& mm = v->type.tensor;
    const Dim n_dim = mm.sizes[1];
    const bool conv = matmul.op == "aten::convolution";  // its epilogue keeps the NCHW shape: no views, no rows
    const bool torch_conv = conv && !onednn_convolutions_requested();  // its chain stops at what torch's call applies
    std::vector<EpilogueOp> ops;
    while (uses_[v] == 1) {
      Node* next = user_[v];
      if (next->group >= 0 || next->outputs.size() != 1 || !next->outputs[0]->type.is_tensor()) break;
      auto op = as_epilogue(*next, v);
      if (!op) break;
      const TensorType& in = v->type.tensor;
      const TensorType& out = next->outputs[0]->type.tensor;
      if (out.dtype != mm.dtype || out.device != mm.device) break;
      if (conv && op->kind == EpilogueOp::Kind::View) break;
      if (op->kind == EpilogueOp::Kind::View) {
        // Any view of the row-major [M, N] result that keeps N as its last dimension.
        if (out.sizes.empty() || !(out.sizes.back() == n_dim) || !reads_only_before(*next, index)) break;
      } else if (!(out.sizes == in.sizes)) {
        break;
      }
      if (op->kind == EpilogueOp::Kind::Add) {
        const TensorType& add = op->addend->type.tensor;
        if (add.dtype != mm.dtype || add.device != mm.device) break;
        if (!(add.sizes == out.sizes) && (conv || !is_row_of(add, n_dim))) break;
        auto pos = position_.find(op->addend);
        if (pos != position_.end() && pos->second >= index) break;
      }
      if (torch_conv) {
        ops.push_back(*op);
        if (!torch_conv_takes(ops)) break;
      }
      members.push_back(next);
      v = next->outputs[0];
    }
    return members;
  }

  // Every value `n` reads (SymInt sizes of a view) exists before the matmul at `index`.
  bool reads_only_before(const Node& n, size_t index) const {
    bool ok = true;
    for (size_t a = 1; a < n.args.size(); ++a)
      n.args[a].for_each_value([&](const Value* v) {
        auto pos = position_.find(v);
        if (pos != position_.end() && pos->second >= index) ok = false;
      });
    return ok;
  }

  Graph& graph_;
  bool inference_ = false;                   // an inference graph whose parameters are known (item 3)
  std::unordered_set<const Value*> passed_;  // inputs the caller passes (not parameters), where those are known (item 3)
  std::unordered_map<const Value*, size_t> position_;
  std::unordered_map<const Value*, int> uses_;
  std::unordered_map<const Value*, Node*> user_;  // meaningful where uses_ is 1
};

}  // namespace

void claim_matmul_epilogues(Graph& graph, PassContext& ctx) { Claimer(graph, ctx.options.cached_inputs).run(); }

}  // namespace ember
