// A fused CUDA kernel: the group's module (cuda_source.h), compiled with NVRTC when the plan is built or on a
// thread of its own (a deferred kernel; its fallback entries on first use), launched on ATen's current
// stream with the entry point and grid call_plan.h picks per call. The device's multiprocessor count, and
// each entry point's largest block and resident blocks per multiprocessor, are queried once per entry, here.
#include "kernels/cuda/cuda_kernel.h"

#include "ember/config.h"
#include "ember/error.h"
#include "kernels/cuda/call_plan.h"
#include "kernels/cuda/cuda_source.h"
#include "kernels/cuda/driver.h"
#include "kernels/cuda/launch_tuning.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <future>
#include <memory>
#include <string>
#include <mutex>
#include <system_error>

namespace ember::cuda {
namespace {

// Background compiles running in the process (wait_for_background_compiles).
struct Background {
  std::mutex mu;
  std::condition_variable idle;
  int running = 0;
  bool exit_waits = false;  // wait_for_background_compiles is registered with atexit
};
Background& background() {
  static Background* b = new Background;  // never destroyed: a compile may end during exit
  return *b;
}

// The functions of `source`'s entry points in CallPlan::entry order (general, vector, strided vector for
// flat groups; general and the row variants for row groups; the general alone for column groups): the
// modules that hold them compiled, the fallback entries (FusedCudaKernel) null unless a package's export or load
// (`images`) asks for them: it must hold every image.
std::vector<void*> compile_entries(const CudaSource& source, int device, ImageStore* images) {
  std::vector<std::string> entries;
  if (!source.vector_entry.empty()) entries.push_back(source.vector_entry);
  for (const RowVariant& v : source.rows) entries.push_back(v.entry);
  std::vector<void*> functions;
  if (!source.entries_text.empty()) {  // the general entry a module apart (cuda_source.h)
    std::future<void*> general;
    if (images)
      general = std::async(std::launch::async, [&] { return compile(source.general_text, source.general, device, images); });
    std::vector<void*> others = compile(source.entries_text, entries, device, images);
    functions.push_back(general.valid() ? general.get() : nullptr);
    functions.insert(functions.end(), others.begin(), others.end());
  } else {
    entries.insert(entries.begin(), source.general);
    functions = compile(source.text, entries, device, images);
  }
  if (!source.strided_vector_entry.empty())
    functions.push_back(images ? compile(source.strided_text, source.strided_vector_entry, device, images) : nullptr);
  return functions;
}

// Entry points in CallPlan::entry order (compile_entries). Two entries are fallbacks that compile on first
// use, each a module of its own: a flat group's strided entry (strided_text: misaligned or irregularly
// strided inputs), and the general entry of a group whose other entries are a module apart (general_text:
// rows no variant takes, outputs below one vector; a third of the group's NVRTC time, GPT-2's modules 65-104
// of 250-290 ms on the 2-core host). Until then an entry's slot in functions_ is null and its launch limits
// are unknown.
//
// A deferred kernel (make_fused_kernel) has no functions yet: its modules compile on a thread of their own
// (compile_in_background), and until they are loaded compiling() says so, the plan's stand-in runs the
// group's ATen ops, and a call without one waits for the compile.
class FusedCudaKernel : public Kernel {
 public:
  FusedCudaKernel(Program program, CudaSource source, const std::vector<void*>& functions, int device, bool deferred)
      : p_(std::move(program)), source_(std::move(source)), device_(device), entries_(functions.size()),
        functions_(new std::atomic<void*>[functions.size()]), loaded_(!deferred) {
    for (const ProgramOutput& o : p_.outputs) out_dtypes_.push_back(o.value->type.tensor.dtype);
    LaunchLimits& limits = snapshots_.emplace_back();
    limits.multiprocessors = multiprocessor_count(device_);
    for (size_t entry = 0; entry < entries_; ++entry) {
      functions_[entry].store(functions[entry], std::memory_order_relaxed);
      if (functions[entry]) set_limits(limits, entry, functions[entry]);
    }
    limits_.store(&limits, std::memory_order_release);
  }

  ~FusedCudaKernel() override {
    abandoned_.store(true);  // a compile not started yet need not start
    if (background_.valid()) background_.wait();  // it writes this kernel's members
  }

  // Compiles the kernel's modules (compile_entries) on a thread of its own and publishes their functions
  // when loaded. A failure leaves compiling() true, so that the group's stand-in runs every call.
  void compile_in_background() {
    background_ = start_background_compile([this] { load_all(); });
  }

  // The modules compiled and their functions published with limits that know them.
  void load_all() {
    try {
      std::vector<void*> loaded;
      if (!abandoned_.load()) loaded = compile_entries(source_, device_, nullptr);
      if (!loaded.empty()) {
        std::lock_guard<std::mutex> lock(load_mu_);
        LaunchLimits& limits = snapshots_.emplace_back(*limits_.load(std::memory_order_acquire));
        for (size_t entry = 0; entry < loaded.size() && entry < entries_; ++entry) {
          if (!loaded[entry]) continue;
          set_limits(limits, entry, loaded[entry]);
          functions_[entry].store(loaded[entry], std::memory_order_release);
        }
        limits_.store(&limits, std::memory_order_release);
        loaded_.store(true, std::memory_order_release);
      }
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(load_mu_);
      background_error_ = e.what();
      failed_.store(true, std::memory_order_release);
    }
  }

  bool compiling() const override {
    if (loaded_.load(std::memory_order_acquire)) return false;
    if (failed_.load(std::memory_order_acquire)) return true;
    c10::Device device(c10::kCUDA, static_cast<c10::DeviceIndex>(device_));
    return !capturing(c10::impl::getDeviceGuardImpl(c10::kCUDA)->getStream(device).native_handle());
  }

  std::string describe() const override {
    std::string failed;
    {
      std::lock_guard<std::mutex> lock(load_mu_);
      if (!background_error_.empty()) failed = "; it failed to compile, its ATen ops run: " + background_error_;
    }
    return "cuda fused group " + std::to_string(p_.group) + " (" + std::to_string(p_.code.size()) +
           " instructions" + (!p_.has_reduction ? "" : p_.outer ? ", column reductions" : ", row reductions") + failed + ")";
  }

  void run(std::vector<c10::IValue>& buffers, const std::vector<uint32_t>& reads,
           const std::vector<uint32_t>& writes) const override {
    c10::Device device(c10::kCUDA, static_cast<c10::DeviceIndex>(device_));
    c10::DeviceGuard guard(device);
    void* stream = c10::impl::getDeviceGuardImpl(c10::kCUDA)->getStream(device).native_handle();
    CallPlan plan = planned(buffers, reads, device);
    if (plan.launch) launch_call(plan, stream, device);
    for (size_t k = 0; k < plan.outputs.size(); ++k) buffers[writes[k]] = std::move(plan.outputs[k]);
  }

 protected:
  // The call's plan (call_plan.h) once its kernel is loaded and the entry it takes compiled.
  CallPlan planned(const std::vector<c10::IValue>& buffers, const std::vector<uint32_t>& reads, c10::Device device) const {
    if (!loaded_.load(std::memory_order_acquire)) {  // deferred: a call without a stand-in, or being captured
      if (background_.valid()) background_.wait();
      if (!loaded_.load(std::memory_order_acquire)) {
        std::lock_guard<std::mutex> lock(load_mu_);
        throw Error("CUDA fused group " + std::to_string(p_.group) + " failed to compile: " + background_error_);
      }
    }
    const LaunchLimits* limits = limits_.load(std::memory_order_acquire);
    CallPlan plan = plan_call(p_, source_, out_dtypes_, buffers, reads, device, *limits);
    while (plan.launch && !compiled(*limits, plan.entry)) {
      load(plan.entry);  // a fallback entry's first use: compiled now, and the call planned again by its limits
      limits = limits_.load(std::memory_order_acquire);
      plan = plan_call(p_, source_, out_dtypes_, buffers, reads, device, *limits);
    }
    return plan;
  }

  // Launches `plan`, whose entry is compiled.
  void launch_call(CallPlan& plan, void* stream, c10::Device device) const {
    void* function = functions_[plan.entry].load(std::memory_order_acquire);
    if (plan.splits > 1) provide_workspace(plan, stream, device);
    launch(function, plan.blocks, plan.threads, stream, plan.params.data(), device_, plan.splits);
  }

  // Every block size `entry` may launch with, asked once so that calls ask the driver nothing. Entries
  // before it that are not compiled yet keep unknown limits (LaunchLimits: 1024 threads, a wave estimated).
  static void set_limits(LaunchLimits& limits, size_t entry, void* function) {
    if (limits.max_threads.size() <= entry) {
      limits.max_threads.resize(entry + 1, 1024);
      limits.resident.resize(entry + 1);
    }
    const int most = max_threads_per_block(function);
    limits.max_threads[entry] = most;
    std::vector<int>& resident = limits.resident[entry];
    resident.clear();
    for (int threads = 32; threads <= 1024; threads += 32) resident.push_back(threads <= most ? resident_blocks(function, threads) : 0);
  }

  // A fallback entry, compiled on the first call that needs it: its function published, then launch limits
  // that know it (a snapshot of their own, so that calls reading the old ones are never disturbed).
  void load(size_t entry) const {
    std::lock_guard<std::mutex> lock(load_mu_);
    if (compiled(*limits_.load(std::memory_order_acquire), entry)) return;
    const bool strided = !p_.has_reduction && entry == kStridedEntry;
    void* function = strided ? compile(source_.strided_text, source_.strided_vector_entry, device_, nullptr)
                             : compile(source_.general_text, source_.general, device_, nullptr);
    LaunchLimits& limits = snapshots_.emplace_back(*limits_.load(std::memory_order_acquire));
    set_limits(limits, entry, function);
    functions_[entry].store(function, std::memory_order_release);
    limits_.store(&limits, std::memory_order_release);
  }

  // Whether `limits` know `entry`: then it is compiled, and its function was published before them.
  static bool compiled(const LaunchLimits& limits, size_t entry) {
    return entry < limits.resident.size() && !limits.resident[entry].empty();
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

  static constexpr size_t kStridedEntry = 2;  // of flat groups (call_plan.cpp, plan_flat); rows use 2 for a variant

  Program p_;
  CudaSource source_;
  int device_;
  std::vector<c10::ScalarType> out_dtypes_;
  size_t entries_;
  // Per entry, its function: null until a fallback entry is compiled (load), then written once. A call reads
  // it where the limits it planned by know the entry (compiled).
  std::unique_ptr<std::atomic<void*>[]> functions_;
  // The launch limits of the entries compiled so far: snapshots_ holds each version (a deque: addresses
  // stay), limits_ the newest.
  mutable std::mutex load_mu_;
  mutable std::deque<LaunchLimits> snapshots_;
  mutable std::atomic<const LaunchLimits*> limits_{nullptr};
  // Column groups' workspaces per stream (provide_workspace).
  struct Workspace {
    void* stream;
    at::Tensor counters, part;  // int32 words; part holds floats
  };
  mutable std::mutex workspace_mu_;
  mutable std::vector<Workspace> workspaces_;
  mutable std::vector<at::Tensor> outgrown_;
  // A deferred kernel's background compile; its failure (under load_mu_). loaded_: the functions compiled
  // are published (at once where the kernel was not deferred).
  std::shared_future<void> background_;
  std::string background_error_;
  std::atomic<bool> loaded_, failed_{false}, abandoned_{false};
};

// A fused kernel under max-autotune: each call shape's launch is timed at its first call (launch_tuning.h) and
// looked up by later calls; the default mode's kernels are FusedCudaKernel itself, untouched by any of it.
class TunedCudaKernel final : public FusedCudaKernel {
 public:
  TunedCudaKernel(Program program, CudaSource source, const std::vector<void*>& functions, int device, Tuning tuning)
      : FusedCudaKernel(std::move(program), std::move(source), functions, device, false),
        tuner_(std::move(tuning), p_, source_, device) {}

  void run(std::vector<c10::IValue>& buffers, const std::vector<uint32_t>& reads,
           const std::vector<uint32_t>& writes) const override {
    c10::Device device(c10::kCUDA, static_cast<c10::DeviceIndex>(device_));
    c10::DeviceGuard guard(device);
    void* stream = c10::impl::getDeviceGuardImpl(c10::kCUDA)->getStream(device).native_handle();
    CallPlan plan = planned(buffers, reads, device);
    if (plan.launch) {
      const LaunchChoice* choice = tuner_.find(plan);
      if (!choice && !tuner_.full()) choice = tune(plan, stream, device);
      if (choice) apply_launch(plan, *choice, source_);
      launch_call(plan, stream, device);
    }
    for (size_t k = 0; k < plan.outputs.size(); ++k) buffers[writes[k]] = std::move(plan.outputs[k]);
  }

  std::vector<std::string> tuning() const override {
    std::vector<std::string> out = tuner_.lines();
    for (std::string& line : out) line = "fused group " + std::to_string(p_.group) + " " + line;
    return out;
  }

 private:
  // Every launch `plan` may take is timed on its buffers: each candidate runs the call into its own outputs
  // (fresh from plan_call; the kernel only reads its inputs), and the caller's launch, with the winner, comes last.
  const LaunchChoice* tune(const CallPlan& plan, void* stream, c10::Device device) const {
    auto candidates = [&] {
      // A row group's general entry compiled for its turn (otherwise on first use; its variants are compiled
      // with the kernel). Flat groups keep plan's entry, which their pointers decide.
      if (p_.has_reduction && p_.outer == 0 && !compiled(*limits_.load(std::memory_order_acquire), 0)) load(0);
      return launch_candidates(plan, p_, source_, *limits_.load(std::memory_order_acquire));
    };
    auto launch_as = [&](const LaunchChoice& c) {
      CallPlan trial = plan;
      apply_launch(trial, c, source_);
      launch_call(trial, stream, device);
      return true;
    };
    return tuner_.choose(plan, candidates, launch_as, stream);
  }

  mutable LaunchTuner tuner_;
};

}  // namespace

// EMBER_CUDA_BACKGROUND=0: every module compiles when the plan is built (for measuring what deferring saves
// the first call, or for a first call that should already run the kernels later calls keep).
// Read per kernel (when the plan is built, never per call), so that tests can switch it.
bool background_compiles() {
  return !config_is("EMBER_CUDA_BACKGROUND", "0");
}

std::shared_future<void> start_background_compile(std::function<void()> compile) {
  Background& b = background();
  {
    std::lock_guard<std::mutex> lock(b.mu);
    if (b.running++ == 0 && !b.exit_waits) {
      // A compile still running when the process exits would go on using NVRTC and the driver while their
      // libraries finalize: exit waits for it (atexit handlers run before libraries' finalizers).
      std::atexit(wait_for_background_compiles);
      b.exit_waits = true;
    }
  }
  count_background_compile();
  auto run = [compile = std::move(compile)] {
    try {
      compile();
    } catch (...) {  // `compile` keeps its own failures; nothing may escape the count below
    }
    Background& b = background();
    std::lock_guard<std::mutex> lock(b.mu);
    if (--b.running == 0) b.idle.notify_all();
  };
  try {
    return std::async(std::launch::async, run).share();
  } catch (const std::system_error&) {  // no thread to be had: compiled here instead
    run();
    std::promise<void> done;
    done.set_value();
    return done.get_future().share();
  }
}

void wait_for_background_compiles() {
  Background& b = background();
  std::unique_lock<std::mutex> lock(b.mu);
  b.idle.wait(lock, [&] { return b.running == 0; });
}

std::shared_ptr<const Kernel> make_fused_kernel(Program program, std::string* listing, std::string* why_not,
                                                ImageStore* images, const Tuning& tuning) {
  if (!available(why_not)) return nullptr;
  int device = program.device.has_index() ? program.device.index() : 0;
  // One name for every kernel: the source then depends on the program alone, so identical groups (a
  // transformer's repeated layers) share one compiled module.
  CudaSource source = generate(program, "ember_fused");
  if (listing) {
    *listing += "// group " + std::to_string(program.group) + "\n" + source.text;
    if (!source.entries_text.empty())
      *listing += "// (" + source.general + ", the general entry, compiles from its part of this source on first use)\n";
    if (!source.strided_vector_entry.empty())
      *listing += "// (" + source.strided_vector_entry + ", the strided vector entry, compiles from this source on first use)\n";
    *listing += "\n";
  }
  const size_t entries = 1 + (source.vector_entry.empty() ? 0 : 1) + source.rows.size() +
                         (source.strided_vector_entry.empty() ? 0 : 1);
  // Tuned kernels compile now: a deferred one's first calls would run its stand-in, and under max-autotune the
  // call after them is captured into a CUDA graph, where nothing can be timed.
  const bool tuned = tuning.exhaustive && !images && launch_timer();
  if (!images && !tuned && background_compiles() && !has_image(source.entries_text.empty() ? source.text : source.entries_text, device)) {
    auto kernel = std::make_shared<FusedCudaKernel>(std::move(program), std::move(source), std::vector<void*>(entries, nullptr),
                                                    device, true);
    kernel->compile_in_background();
    return kernel;
  }
  std::vector<void*> functions = compile_entries(source, device, images);
  if (tuned) return std::make_shared<TunedCudaKernel>(std::move(program), std::move(source), functions, device, tuning);
  return std::make_shared<FusedCudaKernel>(std::move(program), std::move(source), functions, device, false);
}

}  // namespace ember::cuda
