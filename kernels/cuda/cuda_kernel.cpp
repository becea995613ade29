// A fused CUDA kernel: the group's module (cuda_source.h), compiled with NVRTC when the plan is built,
// launched on ATen's current stream with the entry point and grid call_plan.h picks per call. The
// device's multiprocessor count, and each entry point's largest block and resident blocks per
// multiprocessor, are queried once, here.
#include "kernels/cuda/cuda_kernel.h"

#include "ember/error.h"
#include "kernels/cuda/call_plan.h"
#include "kernels/cuda/cuda_source.h"
#include "kernels/cuda/driver.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <future>
#include <string>
#include <mutex>

namespace ember::cuda {
namespace {

// Entry points in CallPlan::entry order: general, vector, strided vector (flat groups) or the row
// variants (column groups have the general entry alone). A flat group's strided entry is compiled on first use (cuda_source.h, strided_text) unless
// `images` is given (a package is exported or loaded: it must hold every image), so until then
// functions_ has one entry fewer, and limits_ does not know it.
class FusedCudaKernel final : public Kernel {
 public:
  FusedCudaKernel(Program program, CudaSource source, std::vector<void*> functions, int device)
      : p_(std::move(program)), source_(std::move(source)), functions_(std::move(functions)), device_(device) {
    for (const ProgramOutput& o : p_.outputs) out_dtypes_.push_back(o.value->type.tensor.dtype);
    limits_.multiprocessors = multiprocessor_count(device_);
    for (void* function : functions_) add_limits(limits_, function);
    if (!p_.has_reduction && functions_.size() > kStridedEntry) {  // compiled with the rest
      strided_function_ = functions_[kStridedEntry];
      full_limits_ = limits_;
      strided_ready_.store(true, std::memory_order_release);
    }
  }

  std::string describe() const override {
    return "cuda fused group " + std::to_string(p_.group) + " (" + std::to_string(p_.code.size()) +
           " instructions" + (!p_.has_reduction ? "" : p_.outer ? ", column reductions" : ", row reductions") + ")";
  }

  void run(std::vector<c10::IValue>& buffers, const std::vector<uint32_t>& reads,
           const std::vector<uint32_t>& writes) const override {
    c10::Device device(c10::kCUDA, static_cast<c10::DeviceIndex>(device_));
    c10::DeviceGuard guard(device);
    const bool strided_ready = strided_ready_.load(std::memory_order_acquire);
    CallPlan plan = plan_call(p_, source_, out_dtypes_, buffers, reads, device, strided_ready ? full_limits_ : limits_);
    const bool flat = !p_.has_reduction;
    if (plan.launch && flat && plan.entry == kStridedEntry && !strided_ready) {
      std::call_once(strided_once_, [&] { load_strided(); });
      plan = plan_call(p_, source_, out_dtypes_, buffers, reads, device, full_limits_);  // its grid, by its limits
    }
    if (plan.launch) {
      void* stream = c10::impl::getDeviceGuardImpl(c10::kCUDA)->getStream(device).native_handle();
      void* function = flat && plan.entry == kStridedEntry ? strided_function_ : functions_[plan.entry];
      if (plan.splits > 1) provide_workspace(plan, stream, device);
      launch(function, plan.blocks, plan.threads, stream, plan.params.data(), device_, plan.splits);
    }
    for (size_t k = 0; k < plan.outputs.size(); ++k) buffers[writes[k]] = std::move(plan.outputs[k]);
  }

 private:
  static constexpr size_t kStridedEntry = 2;  // of flat groups (call_plan.cpp, plan_flat); rows use 2 for a variant

  // Every block size an entry may launch with, asked once so that calls ask the driver nothing.
  static void add_limits(LaunchLimits& limits, void* function) {
    const int most = max_threads_per_block(function);
    limits.max_threads.push_back(most);
    std::vector<int>& resident = limits.resident.emplace_back();
    for (int threads = 32; threads <= 1024; threads += 32) resident.push_back(threads <= most ? resident_blocks(function, threads) : 0);
  }

  // A column group's call whose rows split (call_plan.h) needs counters that start at zero (the kernel
  // sets each back to zero when it ends) and room for the chunks' results. Both are kept per stream, so
  // calls on different streams never share them, and grown when a call needs more; the memory of an
  // outgrown buffer stays allocated, since a CUDA graph captured with it keeps its address. Allocated on
  // the calling stream, in order before the kernel: no memset per call, no allocation after the first.
  void provide_workspace(CallPlan& plan, void* stream, c10::Device device) const {
    std::lock_guard<std::mutex> lock(workspace_mu_);
    Workspace* w = nullptr;
    for (Workspace& x : workspaces_)
      if (x.stream == stream) w = &x;
    if (!w) w = &workspaces_.emplace_back(Workspace{stream, {}, {}});
    auto grown = [&](at::Tensor& t, int64_t need, bool zeroed) {
      if (t.defined() && t.numel() >= need) return;
      if (t.defined()) outgrown_.push_back(t);
      const int64_t size = std::max<int64_t>(need, t.defined() ? 2 * t.numel() : 0);
      const at::TensorOptions options = at::TensorOptions().device(device).dtype(at::kInt);
      t = zeroed ? at::zeros({size}, options) : at::empty({size}, options);
    };
    grown(w->counters, plan.counters, true);
    grown(w->part, plan.workspace_floats, false);
    set_workspace(plan, static_cast<float*>(w->part.data_ptr()), static_cast<unsigned*>(w->counters.data_ptr()));
  }

  // Once, on the first call that needs it (std::call_once orders it before every later use).
  void load_strided() const {
    strided_function_ = compile(source_.strided_text, source_.strided_vector_entry, device_, nullptr);
    full_limits_ = limits_;
    add_limits(full_limits_, strided_function_);
    strided_ready_.store(true, std::memory_order_release);
  }

  Program p_;
  CudaSource source_;
  std::vector<void*> functions_;  // general, then the vector entries (flat) or the row variants in order
  int device_;
  LaunchLimits limits_;           // of functions_
  std::vector<c10::ScalarType> out_dtypes_;
  // The strided entry, where it is compiled lazily: written once under strided_once_.
  mutable std::once_flag strided_once_;
  mutable std::atomic<bool> strided_ready_{false};
  mutable void* strided_function_ = nullptr;
  mutable LaunchLimits full_limits_;  // limits_ and the strided entry's
  // Column groups' workspaces per stream (provide_workspace).
  struct Workspace {
    void* stream;
    at::Tensor counters, part;  // int32 words; part holds floats
  };
  mutable std::mutex workspace_mu_;
  mutable std::vector<Workspace> workspaces_;
  mutable std::vector<at::Tensor> outgrown_;
};

}  // namespace

std::shared_ptr<const Kernel> make_fused_kernel(Program program, std::string* listing, std::string* why_not,
                                                ImageStore* images) {
  if (!available(why_not)) return nullptr;
  int device = program.device.has_index() ? program.device.index() : 0;
  // One name for every kernel: the source then depends on the program alone, so identical groups (a
  // transformer's repeated layers) share one compiled module.
  CudaSource source = generate(program, "ember_fused");
  if (listing) {
    *listing += "// group " + std::to_string(program.group) + "\n" + source.text;
    if (!source.strided_vector_entry.empty())
      *listing += "// (" + source.strided_vector_entry + ", the strided vector entry, compiles from this source on first use)\n";
    *listing += "\n";
  }
  std::vector<std::string> entries;
  if (!source.vector_entry.empty()) entries.push_back(source.vector_entry);
  for (const RowVariant& v : source.rows) entries.push_back(v.entry);
  std::vector<void*> functions;
  if (!source.entries_text.empty()) {  // two modules compiled at once (cuda_source.h)
    auto general = std::async(std::launch::async,
                              [&] { return compile(source.general_text, source.general, device, images); });
    std::vector<void*> others = compile(source.entries_text, entries, device, images);
    functions.push_back(general.get());
    functions.insert(functions.end(), others.begin(), others.end());
  } else {
    entries.insert(entries.begin(), source.general);
    functions = compile(source.text, entries, device, images);
  }
  // Packages hold every image: exporting or loading one compiles the strided entry now.
  // EMBER_CUDA_STRIDED=eager does so always (a measuring switch: the first call's cost of doing so).
  static const bool eager = [] {
    const char* v = std::getenv("EMBER_CUDA_STRIDED");
    return v && std::string(v) == "eager";
  }();
  if ((images || eager) && !source.strided_vector_entry.empty())
    functions.push_back(compile(source.strided_text, source.strided_vector_entry, device, images));
  return std::make_shared<FusedCudaKernel>(std::move(program), std::move(source), std::move(functions), device);
}

}  // namespace ember::cuda
