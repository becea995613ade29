// The dropout seeds of ATen's flash and memory-efficient attention, made to match how their backward runs.
//  1. With dropout, these attention forwards return the random generator's seed and offset as two int64
//     scalars: on the CPU when the stream is not being captured, on the GPU (written by the kernel at
//     each replay) when it is. Their backwards read the seed on the host when not capturing and as a
//     device pointer when capturing, trusting that both ran the same way.
//  2. In reduce-overhead training that trust breaks: a forward captured on its second call hands GPU
//     seeds to a backward still warming up (run eagerly), which dereferenced the device pointer on the
//     host and crashed the process (SIGSEGV in at::native::_efficient_attention_backward on the autograd
//     thread, BERT training on an H200).
//  3. This fast path of the plan (runtime.h) runs before each such backward step: when the stream is not
//     being captured and a seed or offset is a GPU tensor, the step reads a host copy of it instead (one
//     small device-to-host copy, only in eager runs after a captured forward). Everything else, and the
//     op itself, is unchanged: it always lets ATen's op run.
#include "ember/ir.h"
#include "ember/runtime.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>

#include <string>
#include <vector>

namespace ember::cudagraph {
namespace {

bool reads_seeds_on_host(const std::string& op) {
  static const char* const kOps[] = {
      "aten::_scaled_dot_product_efficient_attention_backward",
      "aten::_efficient_attention_backward",
      "aten::_scaled_dot_product_flash_attention_backward",
      "aten::_flash_attention_backward",
  };
  for (const char* name : kOps)
    if (op == name) return true;
  return false;
}

class HostSeeds final : public FastPath {
 public:
  explicit HostSeeds(std::vector<uint32_t> seeds) : seeds_(std::move(seeds)) {}

  bool run(std::vector<c10::IValue>& buffers) const override {
    bool on_device = false;
    for (uint32_t b : seeds_) {
      const at::Tensor* t = buffer_tensor(buffers, b);
      on_device = on_device || (t && t->is_cuda());
    }
    if (!on_device || c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None)
      return false;
    for (uint32_t b : seeds_)
      if (const at::Tensor* t = buffer_tensor(buffers, b); t && t->is_cuda()) buffers[b] = t->to(at::kCPU);
    return false;  // ATen's op runs, reading the host copies
  }
  std::string describe() const override { return "dropout seeds read on the host when not captured"; }

 private:
  std::vector<uint32_t> seeds_;
};

std::shared_ptr<const FastPath> make_host_seeds(const Node& n, const Step& step, const Tuning&) {
  if (!step.op || !reads_seeds_on_host(n.op)) return nullptr;
  std::vector<uint32_t> seeds;
  const auto& args = step.op->schema().arguments();
  for (uint32_t slot = 0; slot < args.size(); ++slot)
    if (args[slot].name() == "philox_seed" || args[slot].name() == "philox_offset")
      if (std::optional<uint32_t> b = slot_buffer(step, slot)) seeds.push_back(*b);
  if (seeds.empty()) return nullptr;
  return std::make_shared<HostSeeds>(std::move(seeds));
}

const bool registered = (register_fast_path(&make_host_seeds), true);

}  // namespace
}  // namespace ember::cudagraph
