// ember::linear_chain (made by passes/linear_chain.cpp): linear layers applied one after another,
//    y = act_i(y @ weights[i] + biases[i]),  y = x first,
// with weights[i] the [K, N] right operand as the GEMM takes it (a linear layer's weight transposed), biases[i]
// None or [N], and activations[i] 0 (none), 1 (ReLU) or 2 (tanh-GELU); then, with softmax 1 or 2, softmax or
// log_softmax over the last dimension (aten::_softmax / _log_softmax without a change of dtype).
//  1. Registered with the dispatcher, so a graph holding it runs anywhere through its OperatorHandle, as any
//     ATen op does. This implementation makes the calls the chain replaced (mm, addmm, _addmm_activation), in
//     order: the same results as before the rewrite. kernels/cuda/linear_chain.cpp runs the chain as one
//     kernel where it can; this runs where it cannot.
//  2. Inference only: the op has no derivative (the pass builds chains only where no intermediate is saved,
//     and a training graph's forward saves them).
#include <ATen/core/List.h>
#include <ATen/ops/_addmm_activation.h>
#include <ATen/ops/_log_softmax.h>
#include <ATen/ops/_softmax.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <stdexcept>
#include <string>

namespace ember {
namespace {

// A std exception (Python sees a RuntimeError): with torch 2.11 a c10::Error thrown here (TORCH_CHECK)
// crashed the process on its way out of the dispatcher (H100 host, pytest), where this does not.
void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("ember::linear_chain: " + what);
}

at::Tensor linear_chain(const at::Tensor& x, at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases,
                        at::IntArrayRef activations, int64_t softmax) {
  require(weights.size() == biases.size() && weights.size() == activations.size(),
          std::to_string(weights.size()) + " weights, " + std::to_string(biases.size()) + " biases and " +
              std::to_string(activations.size()) + " activations");
  at::Tensor y = x;
  for (size_t i = 0; i < weights.size(); ++i) {
    const std::optional<at::Tensor> bias = biases.get(i);
    const int64_t act = activations[i];
    require(act >= 0 && act <= 2, "activation " + std::to_string(act) + " (0 none, 1 ReLU, 2 tanh-GELU)");
    if (!bias || !bias->defined()) {
      require(act == 0, "an activation needs a bias (layer " + std::to_string(i) + ")");
      y = at::mm(y, weights[i]);
    } else if (act == 0) {
      y = at::addmm(*bias, y, weights[i]);
    } else {
      y = at::_addmm_activation(*bias, y, weights[i], 1, 1, act == 2);
    }
  }
  require(softmax >= 0 && softmax <= 2, "softmax " + std::to_string(softmax) + " (0 none, 1 softmax, 2 log_softmax)");
  if (softmax == 1) return at::_softmax(y, -1, false);
  if (softmax == 2) return at::_log_softmax(y, -1, false);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ember, m) {
  m.def("linear_chain(Tensor x, Tensor[] weights, Tensor?[] biases, int[] activations, int softmax=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(ember, CompositeExplicitAutograd, m) { m.impl("linear_chain", &linear_chain); }

}  // namespace ember
