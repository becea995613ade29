// Control flow: torch.cond, while_loop and scan (torch.ops.higher_order), lowered to ember::cond,
// ember::while_loop and ember::scan nodes that name their subgraphs. Each subgraph is a graph of its own,
// compiled (fused, planned) before the graph that calls it; the node runs as one kernel step that reads its
// operands from the buffer table, runs the subgraphs' plans on them and writes the results back:
//
//   ember::cond(pred, "true_graph", "false_graph", [operands])          one branch, chosen by pred
//   ember::while_loop("cond_graph", "body_graph", [carried], [additional])
//   ember::scan("combine_graph", [init], [xs], [additional])           over dim 0 of xs: the carries, then
//                                                                        the stacked per-step outputs
//
// A tensor predicate is read on the host, as eager's cond reads it (a CUDA predicate waits for the device),
// so these steps are never captured into CUDA graphs; the steps around them are.
#include "ember/error.h"
#include "ember/runtime.h"

#include <ATen/ops/stack.h>

namespace ember {
namespace {

// One operand list: per item, a constant or the index of the kernel read that holds it.
struct Operands {
  std::vector<c10::IValue> items;
  std::vector<int32_t> read;  // -1: items[i] as it is

  std::vector<c10::IValue> gather(const std::vector<c10::IValue>& buffers, const std::vector<uint32_t>& reads) const {
    std::vector<c10::IValue> out = items;
    for (size_t i = 0; i < out.size(); ++i)
      if (read[i] >= 0) out[i] = buffers[reads[static_cast<size_t>(read[i])]];
    return out;
  }
};

c10::IValue constant_of(const Arg& a) {
  switch (a.kind) {
    case Arg::Kind::None: return c10::IValue();
    case Arg::Kind::Bool: return c10::IValue(a.b);
    case Arg::Kind::Int: return c10::IValue(a.i);
    case Arg::Kind::Float: return c10::IValue(a.f);
    default: throw Error("control flow operands must be values, numbers, booleans or None");
  }
}

// Reads `a` (a value or a constant) into `ops`, recording its value among the kernel's reads.
void add_operand(const Arg& a, Operands& ops, GroupKernel& gk) {
  if (a.is_value()) {
    ops.items.emplace_back();
    ops.read.push_back(static_cast<int32_t>(gk.reads.size()));
    gk.reads.push_back(a.value);
  } else {
    ops.items.push_back(constant_of(a));
    ops.read.push_back(-1);
  }
}

Operands operand_list(const Node& n, size_t position, GroupKernel& gk) {
  if (position >= n.args.size() || n.args[position].kind != Arg::Kind::List)
    throw Error(n.op + ": argument " + std::to_string(position) + " must be a list of operands");
  Operands ops;
  for (const Arg& a : n.args[position].list) add_operand(a, ops, gk);
  return ops;
}

// The pred of a cond or the result of a while_loop's condition graph, as Python's bool() reads it.
bool truth(const c10::IValue& v) {
  if (v.isBool()) return v.toBool();
  if (v.isInt()) return v.toInt() != 0;
  if (v.isDouble()) return v.toDouble() != 0.0;
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (t.numel() != 1) throw Error("control flow: a predicate tensor must hold one value, not " + std::to_string(t.numel()));
    return t.item().toBool();
  }
  throw Error("control flow: the predicate is neither a tensor nor a number");
}

class ControlFlowKernel : public Kernel {
 public:
  std::string why_not_captured() const override {
    return "control flow (" + kind_ + ") decides on the host which plans run";
  }

 protected:
  ControlFlowKernel(std::string kind) : kind_(std::move(kind)) {}

  static std::vector<c10::IValue> join(std::vector<c10::IValue> a, const std::vector<c10::IValue>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  }
  static std::string steps(const CompiledGraph& g) {
    const size_t n = g.plan().steps.size();
    return std::to_string(n) + (n == 1 ? " step" : " steps");
  }

  std::string kind_;
};

class CondKernel final : public ControlFlowKernel {
 public:
  CondKernel(std::shared_ptr<const CompiledGraph> yes, std::shared_ptr<const CompiledGraph> no, bool pred_read,
             bool pred_constant, Operands ops)
      : ControlFlowKernel("cond"), yes_(std::move(yes)), no_(std::move(no)), pred_read_(pred_read),
        pred_constant_(pred_constant), ops_(std::move(ops)) {}

  void run(std::vector<c10::IValue>& buffers, const std::vector<uint32_t>& reads,
           const std::vector<uint32_t>& writes) const override {
    const bool pred = pred_read_ ? truth(buffers[reads[0]]) : pred_constant_;
    std::vector<c10::IValue> outs = (pred ? yes_ : no_)->run(ops_.gather(buffers, reads));
    for (size_t k = 0; k < writes.size(); ++k) buffers[writes[k]] = std::move(outs[k]);
  }

  std::string describe() const override {
    return "cond (true: " + steps(*yes_) + ", false: " + steps(*no_) + ")";
  }

 private:
  std::shared_ptr<const CompiledGraph> yes_, no_;
  bool pred_read_, pred_constant_;
  Operands ops_;
};

class WhileLoopKernel final : public ControlFlowKernel {
 public:
  WhileLoopKernel(std::shared_ptr<const CompiledGraph> cond, std::shared_ptr<const CompiledGraph> body,
                  Operands carried, Operands additional)
      : ControlFlowKernel("while_loop"), cond_(std::move(cond)), body_(std::move(body)), carried_(std::move(carried)),
        additional_(std::move(additional)) {}

  void run(std::vector<c10::IValue>& buffers, const std::vector<uint32_t>& reads,
           const std::vector<uint32_t>& writes) const override {
    std::vector<c10::IValue> carried = carried_.gather(buffers, reads);
    const std::vector<c10::IValue> additional = additional_.gather(buffers, reads);
    while (truth(cond_->run(join(carried, additional)).at(0))) carried = body_->run(join(std::move(carried), additional));
    for (size_t k = 0; k < writes.size(); ++k) buffers[writes[k]] = std::move(carried[k]);
  }

  std::string describe() const override {
    return "while_loop (cond: " + steps(*cond_) + ", body: " + steps(*body_) + ")";
  }

 private:
  std::shared_ptr<const CompiledGraph> cond_, body_;
  Operands carried_, additional_;
};

class ScanKernel final : public ControlFlowKernel {
 public:
  ScanKernel(std::shared_ptr<const CompiledGraph> combine, Operands init, Operands xs, Operands additional)
      : ControlFlowKernel("scan"), combine_(std::move(combine)), init_(std::move(init)), xs_(std::move(xs)),
        additional_(std::move(additional)) {}

  void run(std::vector<c10::IValue>& buffers, const std::vector<uint32_t>& reads,
           const std::vector<uint32_t>& writes) const override {
    std::vector<c10::IValue> carry = init_.gather(buffers, reads);
    const std::vector<c10::IValue> xs = xs_.gather(buffers, reads);
    const std::vector<c10::IValue> additional = additional_.gather(buffers, reads);
    const int64_t length = xs.front().toTensor().size(0);
    if (length == 0) throw Error("scan over a dimension of size 0");
    const size_t carries = carry.size(), per_step = writes.size() - carries;
    std::vector<std::vector<at::Tensor>> ys(per_step);
    for (int64_t i = 0; i < length; ++i) {
      std::vector<c10::IValue> in = std::move(carry);
      for (const c10::IValue& x : xs) in.emplace_back(x.toTensor().select(0, i));
      in.insert(in.end(), additional.begin(), additional.end());
      std::vector<c10::IValue> out = combine_->run(std::move(in));
      carry.assign(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(carries));
      for (size_t j = 0; j < per_step; ++j) ys[j].push_back(out[carries + j].toTensor());
    }
    for (size_t k = 0; k < carries; ++k) buffers[writes[k]] = std::move(carry[k]);
    for (size_t j = 0; j < per_step; ++j) buffers[writes[carries + j]] = at::stack(ys[j], 0);
  }

  std::string describe() const override { return "scan (combine: " + steps(*combine_) + ")"; }

 private:
  std::shared_ptr<const CompiledGraph> combine_;
  Operands init_, xs_, additional_;
};

}  // namespace

GroupKernel make_control_flow_kernel(const Node& n, const Subgraphs& subgraphs) {
  auto subgraph = [&](size_t position, size_t inputs, size_t outputs) {
    if (position >= n.args.size() || n.args[position].kind != Arg::Kind::String)
      throw Error(n.op + ": argument " + std::to_string(position) + " must name a subgraph");
    const std::string& name = n.args[position].s;
    auto it = subgraphs.find(name);
    if (it == subgraphs.end() || !it->second) throw Error(n.op + ": subgraph '" + name + "' was not compiled with the graph");
    const CompiledGraph& g = *it->second;
    if (g.num_inputs() != inputs || g.plan().outputs.size() != outputs)
      throw Error(n.op + ": subgraph '" + name + "' takes " + std::to_string(g.num_inputs()) + " inputs and returns " +
                  std::to_string(g.plan().outputs.size()) + " values; the call passes " + std::to_string(inputs) +
                  " and expects " + std::to_string(outputs));
    return it->second;
  };
  GroupKernel gk;
  gk.writes.assign(n.outputs.begin(), n.outputs.end());
  const size_t results = n.outputs.size();
  if (n.op == "ember::cond") {
    if (n.args.size() != 4) throw Error("ember::cond takes (pred, true graph, false graph, operands)");
    bool pred_read = n.args[0].is_value(), pred_constant = false;
    if (pred_read) gk.reads.push_back(n.args[0].value);
    else pred_constant = truth(constant_of(n.args[0]));
    Operands ops = operand_list(n, 3, gk);
    const size_t inputs = ops.items.size();
    gk.kernel = std::make_shared<CondKernel>(subgraph(1, inputs, results), subgraph(2, inputs, results), pred_read,
                                             pred_constant, std::move(ops));
  } else if (n.op == "ember::while_loop") {
    if (n.args.size() != 4) throw Error("ember::while_loop takes (cond graph, body graph, carried, additional)");
    Operands carried = operand_list(n, 2, gk), additional = operand_list(n, 3, gk);
    const size_t inputs = carried.items.size() + additional.items.size();
    if (results != carried.items.size()) throw Error("ember::while_loop returns its carried values");
    gk.kernel = std::make_shared<WhileLoopKernel>(subgraph(0, inputs, 1), subgraph(1, inputs, carried.items.size()),
                                                  std::move(carried), std::move(additional));
  } else if (n.op == "ember::scan") {
    if (n.args.size() != 4) throw Error("ember::scan takes (combine graph, init, xs, additional)");
    Operands init = operand_list(n, 1, gk), xs = operand_list(n, 2, gk), additional = operand_list(n, 3, gk);
    if (xs.items.empty()) throw Error("ember::scan needs at least one tensor to scan over");
    for (int32_t r : xs.read)
      if (r < 0) throw Error("ember::scan scans over tensors, not constants");
    if (results < init.items.size()) throw Error("ember::scan returns its carries first");
    const size_t inputs = init.items.size() + xs.items.size() + additional.items.size();
    gk.kernel = std::make_shared<ScanKernel>(subgraph(0, inputs, results), std::move(init), std::move(xs),
                                             std::move(additional));
  } else {
    throw Error("not a control flow op: " + n.op);
  }
  return gk;
}

}  // namespace ember
