// A fused CUDA kernel: the group's module (cuda_source.h), compiled with NVRTC when the plan is built,
// launched on ATen's current stream with the entry point and grid call_plan.h picks per call. The
// device's multiprocessor count, and each entry point's largest block and resident blocks per
// multiprocessor, are queried once, here.
#include "kernels/cuda/cuda_kernel.h"

#include "ember/error.h"
#include "kernels/cuda/call_plan.h"
#include "kernels/cuda/cuda_source.h"
#include "kernels/cuda/driver.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <cstring>

namespace ember::cuda {
namespace {

class FusedCudaKernel final : public Kernel {
 public:
  FusedCudaKernel(Program program, CudaSource source, std::vector<void*> functions, int device)
      : p_(std::move(program)), source_(std::move(source)), functions_(std::move(functions)), device_(device) {
    for (const ProgramOutput& o : p_.outputs) out_dtypes_.push_back(o.value->type.tensor.dtype);
    // Every block size each entry may launch with, asked once here so that calls ask the driver nothing.
    limits_.multiprocessors = multiprocessor_count(device_);
    for (void* function : functions_) {
      const int most = max_threads_per_block(function);
      limits_.max_threads.push_back(most);
      std::vector<int>& resident = limits_.resident.emplace_back();
      for (int threads = 32; threads <= 1024; threads += 32)
        resident.push_back(threads <= most ? resident_blocks(function, threads) : 0);
    }
  }

  std::string describe() const override {
    return "cuda fused group " + std::to_string(p_.group) + " (" + std::to_string(p_.code.size()) +
           " instructions" + (p_.has_reduction ? ", row reductions" : "") + ")";
  }

  void run(std::vector<c10::IValue>& buffers, const std::vector<uint32_t>& reads,
           const std::vector<uint32_t>& writes) const override {
    c10::Device device(c10::kCUDA, static_cast<c10::DeviceIndex>(device_));
    c10::DeviceGuard guard(device);
    CallPlan plan = plan_call(p_, source_, out_dtypes_, buffers, reads, device, limits_);
    if (plan.launch) {
      void* stream = c10::impl::getDeviceGuardImpl(c10::kCUDA)->getStream(device).native_handle();
      launch(functions_[plan.entry], plan.blocks, plan.threads, stream, plan.params.data(), device_);
    }
    for (size_t k = 0; k < plan.outputs.size(); ++k) buffers[writes[k]] = std::move(plan.outputs[k]);
  }

 private:
  Program p_;
  CudaSource source_;
  std::vector<void*> functions_;  // general, then the vector entries (flat) or the row variants in order
  int device_;
  LaunchLimits limits_;
  std::vector<c10::ScalarType> out_dtypes_;
};

}  // namespace

std::shared_ptr<const Kernel> make_fused_kernel(Program program, std::string* listing, std::string* why_not,
                                                ImageStore* images) {
  if (!available(why_not)) return nullptr;
  int device = program.device.has_index() ? program.device.index() : 0;
  // One name for every kernel: the source then depends on the program alone, so identical groups (a
  // transformer's repeated layers) share one compiled module.
  CudaSource source = generate(program, "ember_fused");
  if (listing) *listing += "// group " + std::to_string(program.group) + "\n" + source.text + "\n";
  std::vector<std::string> entries{source.general};
  if (!source.vector_entry.empty()) entries.push_back(source.vector_entry);
  if (!source.strided_vector_entry.empty()) entries.push_back(source.strided_vector_entry);
  for (const RowVariant& v : source.rows) entries.push_back(v.entry);
  std::vector<void*> functions = compile(source.text, entries, device, images);
  return std::make_shared<FusedCudaKernel>(std::move(program), std::move(source), std::move(functions), device);
}

}  // namespace ember::cuda
