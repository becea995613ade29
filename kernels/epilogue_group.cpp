// lower_epilogue_group: a claimed group, re-read member by member through the same classifier the pass used.
#include "kernels/epilogue_group.h"

#include "ember/op_table.h"

namespace ember {
namespace {

bool is_row(const TensorType& t) {
  for (size_t i = 0; i + 1 < t.sizes.size(); ++i)
    if (!(t.sizes[i].is_constant() && t.sizes[i].value == 1)) return false;
  return !t.sizes.empty();
}

const char* op_name(EpilogueOp::Kind k) {
  switch (k) {
    case EpilogueOp::Kind::Relu: return "relu";
    case EpilogueOp::Kind::GeluErf: return "gelu";
    case EpilogueOp::Kind::GeluTanh: return "gelu_tanh";
    case EpilogueOp::Kind::Silu: return "silu";
    case EpilogueOp::Kind::Sigmoid: return "sigmoid";
    case EpilogueOp::Kind::Tanh: return "tanh";
    case EpilogueOp::Kind::Hardswish: return "hardswish";
    case EpilogueOp::Kind::Clamp: return "clamp";
    case EpilogueOp::Kind::Linear: return "scale";
    case EpilogueOp::Kind::Add: return "add";
    case EpilogueOp::Kind::View: return "view";
  }
  return "?";
}

}  // namespace

std::vector<const Value*> EpilogueGroup::reads() const {
  std::vector<const Value*> r = {src, weights};
  if (bias) r.push_back(bias);
  r.insert(r.end(), addends.begin(), addends.end());
  for (const auto& [constant, value] : out_shape)
    if (value) r.push_back(value);
  if (weights_input) r.push_back(weights_input);
  return r;
}

std::string EpilogueGroup::text() const {
  std::string s = std::string(kind == Kind::Conv2d ? "conv2d " : "matmul ") + dtype_name(dtype);
  if (bias) s += " +bias";
  for (size_t i = 0, a = 0; i < ops.size(); ++i) {
    s += std::string(" ") + op_name(ops[i].kind);
    if (ops[i].kind == EpilogueOp::Kind::Add && addend_is_row[a++]) s += "(row)";
  }
  return s;
}

bool is_epilogue_group(const Graph& graph, int group) {
  for (const auto& n : graph.nodes())
    if (n->group == group) return n->op == "aten::mm" || n->op == "aten::addmm" || n->op == "aten::convolution";
  return false;
}

std::optional<EpilogueGroup> lower_epilogue_group(const Graph& graph, int group, std::string* why_not,
                                                  const std::vector<bool>& unversioned) {
  auto fail = [&](const std::string& why) -> std::optional<EpilogueGroup> {
    if (why_not) *why_not = why;
    return std::nullopt;
  };
  EpilogueGroup m;
  m.group = group;
  for (const auto& n : graph.nodes())
    if (n->group == group) m.members.push_back(n.get());
  if (m.members.empty()) return fail("empty group");
  const Node& mm = *m.members.front();
  if (as_conv2d(mm, &m.src, &m.weights, &m.bias)) {
    m.kind = EpilogueGroup::Kind::Conv2d;
    for (int i = 0; i < 2; ++i) {
      m.stride[i] = mm.args[3].list[i].i;
      m.padding[i] = mm.args[4].list[i].i;
      m.dilation[i] = mm.args[5].list[i].i;
    }
    m.groups = mm.args[8].i;
  } else if (!as_matmul(mm, &m.src, &m.weights, &m.bias)) {
    return fail(mm.op + " is not a matmul or convolution ember lowers");
  }
  m.device = mm.outputs[0]->type.tensor.device;
  m.dtype = mm.outputs[0]->type.tensor.dtype;
  const Value* v = mm.outputs[0];
  for (size_t i = 1; i < m.members.size(); ++i) {
    const Node& n = *m.members[i];
    auto op = as_epilogue(n, v);
    if (!op) return fail(n.op + " is not an epilogue of " + v->name);
    if (op->kind == EpilogueOp::Kind::View) {
      if (n.args.size() < 2 || n.args[1].kind != Arg::Kind::List) return fail("view without a size list");
      m.out_shape.clear();
      for (const Arg& d : n.args[1].list) {
        if (d.kind == Arg::Kind::Int) m.out_shape.emplace_back(d.i, nullptr);
        else if (d.is_value()) m.out_shape.emplace_back(0, d.value);
        else return fail("view size of kind other than int or SymInt");
      }
    } else {
      if (op->kind == EpilogueOp::Kind::Add) {
        m.addends.push_back(op->addend);
        const TensorType& t = op->addend->type.tensor;
        m.addend_is_row.push_back(!(t.sizes == n.outputs[0]->type.tensor.sizes) && is_row(t));
      }
      if (op->kind == EpilogueOp::Kind::Linear && !m.ops.empty() && m.ops.back().kind == EpilogueOp::Kind::Linear) {
        // a2 * (a1 * x + b1) + b2 as one step: cheaper, and two linear post-ops in a row gave wrong results
        // with oneDNN 2.6.3 here
        EpilogueOp& prev = m.ops.back();
        prev.beta = op->alpha * prev.beta + op->beta;
        prev.alpha *= op->alpha;
      } else {
        m.ops.push_back(*op);
      }
    }
    v = n.outputs[0];
  }
  m.output = v;
  m.weights_input = input_behind(m.weights);
  // A graph that writes tensors in place does so below autograd, without moving version counters: its
  // weights might change unseen, so they are never packed.
  for (const auto& n : graph.nodes())
    if (op_info(n->op).has(kMutates)) m.weights_input = nullptr;
  const auto& inputs = graph.inputs();
  for (size_t i = 0; i < inputs.size() && i < unversioned.size(); ++i)
    if (unversioned[i] && inputs[i] == m.weights_input) m.weights_input = nullptr;
  return m;
}

}  // namespace ember
