// EmberBackward: the autograd node of a TrainingGraph (see training_graph.h). What AOTAutograd's
// CompiledFunction does per call, done in C++ with the same meaning:
//   1. forward: the user outputs that require grad get this node as grad_fn (views among them are
//      detached first, as AOTAutograd's outputs are never views); the others are marked non-differentiable;
//   2. saved tensors are held as autograd's SavedVariables (in-place changes before backward are an
//      error, saved-tensor hooks apply, backward twice without retain_graph is an error), those AOTAutograd
//      saves without version checks as plain tensors;
//   3. backward: a missing gradient of a differentiable output is zeros, each gradient is put in the layout
//      the backward was traced with, and the plan runs with the saved tensors handed over when the graph is
//      not retained (the plan frees each after its last use); with create_graph the gradients get an error
//      node, as double backward through AOTAutograd's graphs is an error too.
#include "python_bindings/training_graph.h"

#include "ember/error.h"

#include <ATen/Context.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <type_traits>

namespace ember {
namespace {

namespace ag = torch::autograd;
using NodePtr = decltype(ag::Edge::function);  // torch 2.13 holds nodes by intrusive_ptr, earlier by shared_ptr

template <class N, class... Args>
NodePtr make_node(Args&&... args) {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<ag::Node>>) return std::make_shared<N>(std::forward<Args>(args)...);
  else return c10::make_intrusive<N>(std::forward<Args>(args)...);
}

template <class N>
NodePtr self_pointer(N* node) {
  if constexpr (requires { node->getptr(); }) return node->getptr();
  else return node->shared_from_this();
}

at::Tensor in_layout(at::Tensor grad, const TangentLayout& layout) {
  if (layout.memory_format >= 0) {
    const auto format = static_cast<c10::MemoryFormat>(layout.memory_format);
    return grad.is_contiguous(format) ? grad : grad.contiguous(format);
  }
  if (grad.sizes().equals(layout.sizes) && grad.strides().equals(layout.strides)) return grad;
  at::Tensor out = at::empty_strided(layout.sizes, layout.strides, grad.options());
  out.copy_(grad);
  return out;
}

class EmberBackward final : public ag::Node {
 public:
  explicit EmberBackward(std::shared_ptr<const TrainingGraph> graph) : graph_(std::move(graph)) {}

  std::string name() const override { return "EmberBackward"; }
  void will_release_variables() override { release_early_ = true; }
  void release_variables() override {
    for (ag::SavedVariable& s : saved_) s.reset_data();
    unchecked_.clear();
    released_ = true;
  }
  ag::variable_list apply(ag::variable_list&& grads) override;

  std::vector<ag::SavedVariable> saved_;
  std::vector<at::Tensor> unchecked_;

 private:
  std::shared_ptr<const TrainingGraph> graph_;
  bool release_early_ = false;
  bool released_ = false;
};

ag::variable_list EmberBackward::apply(ag::variable_list&& grads) {
  const TrainingGraph& g = *graph_;
  if (released_) throw Error(ag::ERR_BACKWARD_TWICE);
  if (g.deterministic == 0 && at::globalContext().deterministicAlgorithms())
    throw Error("This compiled backward function is being run with torch.use_deterministic_algorithms(True), but it "
                "was traced while torch.use_deterministic_algorithms(False) was set.");
  std::vector<c10::IValue> args;
  args.reserve(saved_.size() + unchecked_.size() + g.tangents.size());
  const NodePtr self = self_pointer(this);
  for (const ag::SavedVariable& s : saved_) args.emplace_back(s.unpack(self));
  for (const at::Tensor& t : unchecked_) args.emplace_back(t);
  if (release_early_) release_variables();
  size_t k = 0;
  for (size_t i = 0; i < g.output_requires_grad.size(); ++i) {
    if (!g.output_requires_grad[i]) continue;
    at::Tensor grad = i < grads.size() ? std::move(grads[i]) : at::Tensor();
    if (!grad.defined()) grad = input_metadata(i).zeros_like();
    args.emplace_back(in_layout(std::move(grad), g.tangents[k++]));
  }
  const bool create_graph = c10::GradMode::is_enabled();
  ag::edge_list grad_edges;
  if (create_graph)
    for (size_t i = args.size() - g.tangents.size(); i < args.size(); ++i)
      grad_edges.push_back(ag::impl::gradient_edge(args[i].toTensor()));
  std::vector<c10::IValue> outs;
  {
    c10::AutoGradMode no_grad(false);
    outs = g.backward->run(std::move(args));
  }
  ag::variable_list result(outs.size());
  for (size_t i = 0; i < outs.size(); ++i)
    if (outs[i].isTensor()) result[i] = std::move(outs[i]).toTensor();
  if (create_graph) {
    NodePtr error = make_node<ag::Error>("torch.compile with ember does not support double backward", std::move(grad_edges));
    for (at::Tensor& r : result)
      if (r.defined() && ag::isDifferentiableType(r.scalar_type())) ag::set_history(r, error);
  }
  return result;
}

}  // namespace

std::vector<c10::IValue> attach_backward(const std::shared_ptr<const TrainingGraph>& graph,
                                         const std::vector<c10::IValue>& inputs, std::vector<c10::IValue> results) {
  const TrainingGraph& g = *graph;
  const size_t n = g.output_requires_grad.size();
  if (results.size() != n + g.saved_checked + g.saved_unchecked)
    throw Error("the compiled forward returned " + std::to_string(results.size()) + " values, expected " +
                std::to_string(n + g.saved_checked + g.saved_unchecked));
  std::vector<c10::IValue> outputs(std::make_move_iterator(results.begin()), std::make_move_iterator(results.begin() + n));

  ag::edge_list edges(inputs.size());
  bool any = false;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].isTensor() || (i < g.no_edge.size() && g.no_edge[i])) continue;
    const at::Tensor& t = inputs[i].toTensor();
    if (!t.requires_grad()) continue;
    edges[i] = ag::impl::gradient_edge(t);
    any = true;
  }
  if (!any || !c10::GradMode::is_enabled()) return outputs;

  NodePtr node_ptr = make_node<EmberBackward>(graph);
  auto* node = static_cast<EmberBackward*>(node_ptr.get());
  node->set_next_edges(std::move(edges));
  for (size_t i = 0; i < n; ++i) {
    if (!g.output_requires_grad[i] || !outputs[i].isTensor()) {
      node->add_input_metadata(ag::Node::undefined_input());
      continue;
    }
    at::Tensor t = outputs[i].toTensor();
    if (t.is_view()) outputs[i] = t = t.detach();
    ag::set_history(t, node_ptr);
  }
  node->saved_.reserve(g.saved_checked);
  for (size_t j = 0; j < g.saved_checked; ++j) {
    at::Tensor t = results[n + j].toTensor();
    if (t.is_view()) t = t.detach();
    node->saved_.emplace_back(t, /*is_output=*/t.grad_fn().get() == node);
  }
  node->unchecked_.reserve(g.saved_unchecked);
  for (size_t j = 0; j < g.saved_unchecked; ++j) {
    at::Tensor t = results[n + g.saved_checked + j].toTensor();
    // An output of this node held here would keep the node alive through itself.
    if (t.is_view() || t.grad_fn().get() == node) t = t.detach();
    node->unchecked_.push_back(std::move(t));
  }
  return outputs;
}

}  // namespace ember
