// NVRTC and the CUDA driver API, loaded on first use with dlopen: ember needs no CUDA headers or
// libraries at build time, and a CPU-only process never touches them. The torch wheel does not ship
// ATen's NVRTC stub, so ember resolves the few entry points it uses itself.
//
// Compiled modules are cached in the process by (source, architecture): identical groups compile once,
// and distinct ones compile concurrently. Before NVRTC runs, an image is looked for in the ImageStore
// when one is given (a deployment package's store holds every image, so loading one needs only the
// driver, not NVRTC), then in the disk cache (disk_cache.h); what NVRTC compiles goes to both.
#include "kernels/cuda/driver.h"

#include "ember/config.h"
#include "ember/error.h"
#include "kernels/compile_threads.h"
#include "kernels/cuda/cuda_prelude.h"
#include "kernels/cuda/disk_cache.h"
#include "kernels/cuda/image_store.h"

#include <dlfcn.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <future>
#include <map>
#include <mutex>
#include <unordered_map>

namespace ember::cuda {
namespace {

using CUresult = int;
using nvrtcResult = int;
using nvrtcProgram = void*;
constexpr int kComputeCapabilityMajor = 75;
constexpr int kComputeCapabilityMinor = 76;
constexpr int kMultiprocessorCount = 16;
constexpr int kFunctionMaxThreadsPerBlock = 0;
constexpr int kMaxSharedMemoryPerBlockOptin = 97;
constexpr int kFunctionMaxDynamicSharedSizeBytes = 8;

// The driver is needed to run anything; NVRTC only to compile what no image store holds.
struct Api {
  // driver
  CUresult (*cuInit)(unsigned);
  CUresult (*cuDeviceGet)(int*, int);
  CUresult (*cuDeviceGetAttribute)(int*, int, int);
  CUresult (*cuCtxGetCurrent)(void**);
  CUresult (*cuCtxSetCurrent)(void*);
  CUresult (*cuDevicePrimaryCtxRetain)(void**, int);
  CUresult (*cuModuleLoadData)(void**, const void*);
  CUresult (*cuModuleGetFunction)(void**, void*, const char*);
  CUresult (*cuLaunchKernel)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                             void**, void**);
  CUresult (*cuGetErrorString)(CUresult, const char**);
  CUresult (*cuGraphLaunch)(void*, void*);
  CUresult (*cuStreamIsCapturing)(void*, int*);
  CUresult (*cuFuncGetAttribute)(int*, int, void*);
  CUresult (*cuFuncSetAttribute)(void*, int, int);
  CUresult (*cuOccupancyMaxActiveBlocksPerMultiprocessor)(int*, void*, int, size_t);
  // CUDA 12 and later; null where the driver lacks it (no TMA)
  CUresult (*cuTensorMapEncodeTiled)(void*, int, unsigned, void*, const uint64_t*, const uint64_t*, const unsigned*,
                                     const unsigned*, int, int, int, int);
  // nvrtc
  nvrtcResult (*nvrtcCreateProgram)(nvrtcProgram*, const char*, const char*, int, const char* const*,
                                    const char* const*);
  nvrtcResult (*nvrtcCompileProgram)(nvrtcProgram, int, const char* const*);
  nvrtcResult (*nvrtcGetProgramLogSize)(nvrtcProgram, size_t*);
  nvrtcResult (*nvrtcGetProgramLog)(nvrtcProgram, char*);
  nvrtcResult (*nvrtcGetCUBINSize)(nvrtcProgram, size_t*);
  nvrtcResult (*nvrtcGetCUBIN)(nvrtcProgram, char*);
  nvrtcResult (*nvrtcDestroyProgram)(nvrtcProgram*);
  const char* (*nvrtcGetErrorString)(nvrtcResult);
  nvrtcResult (*nvrtcVersion)(int*, int*);
  std::string nvrtc_failure;  // non-empty: NVRTC could not be loaded, and why
};

void* open_first(const std::vector<std::string>& names, std::string* tried) {
  for (const std::string& n : names) {
    if (n.empty()) continue;
    if (void* h = dlopen(n.c_str(), RTLD_NOW | RTLD_GLOBAL)) return h;
    *tried += " " + n;
  }
  return nullptr;
}

template <class F>
void bind(void* lib, const char* name, F*& fn) {
  fn = reinterpret_cast<F*>(dlsym(lib, name));
  if (!fn) throw Error(std::string("CUDA: symbol ") + name + " not found");
}

void bind_nvrtc(Api& a) {
  std::string tried;
  const std::string hint = config_value("EMBER_NVRTC_PATH").value_or("");
  void* nvrtc = open_first({hint, "libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"}, &tried);
  if (!nvrtc) throw Error("NVRTC not found (tried" + tried + "); set EMBER_NVRTC_PATH");
  bind(nvrtc, "nvrtcCreateProgram", a.nvrtcCreateProgram);
  bind(nvrtc, "nvrtcCompileProgram", a.nvrtcCompileProgram);
  bind(nvrtc, "nvrtcGetProgramLogSize", a.nvrtcGetProgramLogSize);
  bind(nvrtc, "nvrtcGetProgramLog", a.nvrtcGetProgramLog);
  bind(nvrtc, "nvrtcGetCUBINSize", a.nvrtcGetCUBINSize);
  bind(nvrtc, "nvrtcGetCUBIN", a.nvrtcGetCUBIN);
  bind(nvrtc, "nvrtcDestroyProgram", a.nvrtcDestroyProgram);
  bind(nvrtc, "nvrtcGetErrorString", a.nvrtcGetErrorString);
  bind(nvrtc, "nvrtcVersion", a.nvrtcVersion);
}

const Api& api() {
  static std::once_flag once;
  static Api a;
  static std::string failure;
  std::call_once(once, [] {
    try {
      std::string tried;
      void* driver = open_first({"libcuda.so.1", "libcuda.so"}, &tried);
      if (!driver) throw Error("CUDA driver library not found (tried" + tried + ")");
      bind(driver, "cuInit", a.cuInit);
      bind(driver, "cuDeviceGet", a.cuDeviceGet);
      bind(driver, "cuDeviceGetAttribute", a.cuDeviceGetAttribute);
      bind(driver, "cuCtxGetCurrent", a.cuCtxGetCurrent);
      bind(driver, "cuCtxSetCurrent", a.cuCtxSetCurrent);
      bind(driver, "cuDevicePrimaryCtxRetain", a.cuDevicePrimaryCtxRetain);
      bind(driver, "cuModuleLoadData", a.cuModuleLoadData);
      bind(driver, "cuModuleGetFunction", a.cuModuleGetFunction);
      bind(driver, "cuLaunchKernel", a.cuLaunchKernel);
      bind(driver, "cuGetErrorString", a.cuGetErrorString);
      bind(driver, "cuGraphLaunch", a.cuGraphLaunch);
      bind(driver, "cuStreamIsCapturing", a.cuStreamIsCapturing);
      bind(driver, "cuFuncGetAttribute", a.cuFuncGetAttribute);
      bind(driver, "cuFuncSetAttribute", a.cuFuncSetAttribute);
      bind(driver, "cuOccupancyMaxActiveBlocksPerMultiprocessor", a.cuOccupancyMaxActiveBlocksPerMultiprocessor);
      a.cuTensorMapEncodeTiled = reinterpret_cast<decltype(a.cuTensorMapEncodeTiled)>(dlsym(driver, "cuTensorMapEncodeTiled"));
      if (a.cuInit(0) != 0) throw Error("cuInit failed");
    } catch (const Error& e) {
      failure = e.what();
      return;
    }
    try {
      bind_nvrtc(a);
    } catch (const Error& e) {
      a.nvrtc_failure = e.what();
    }
  });
  if (!failure.empty()) throw Error(failure);
  return a;
}

const Api& nvrtc_api() {
  const Api& a = api();
  if (!a.nvrtc_failure.empty()) throw Error(a.nvrtc_failure);
  return a;
}

void check(CUresult r, const char* what) {
  if (r == 0) return;
  const char* msg = nullptr;
  api().cuGetErrorString(r, &msg);
  throw Error(std::string("CUDA ") + what + " failed: " + (msg ? msg : std::to_string(r)));
}

// Makes the device's primary context current on this thread (the one the CUDA runtime and ATen use).
void make_current(int device) {
  const Api& a = api();
  void* ctx = nullptr;
  check(a.cuCtxGetCurrent(&ctx), "cuCtxGetCurrent");
  if (ctx) return;
  int dev = 0;
  check(a.cuDeviceGet(&dev, device), "cuDeviceGet");
  check(a.cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  check(a.cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
}

std::mutex stats_mu;
CompileStats stats;

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// The warm-up's work (warm_up_async); a std::async future, so a process exiting during it waits for it.
std::mutex warm_mu;
std::shared_future<void>& warm_up_future() {
  static std::shared_future<void> f;
  return f;
}

void wait_for_warm_up() {
  std::shared_future<void> f;
  {
    std::lock_guard<std::mutex> lock(warm_mu);
    f = warm_up_future();
  }
  if (f.valid()) f.wait();
}

}  // namespace

CompileStats compile_stats() {
  std::lock_guard<std::mutex> lock(stats_mu);
  return stats;
}

void count_background_compile() {
  std::lock_guard<std::mutex> lock(stats_mu);
  ++stats.background;
}

bool available(std::string* why_not) {
  try {
    api();
    return true;
  } catch (const Error& e) {
    if (why_not) *why_not = e.what();
    return false;
  }
}

std::string arch(int device) {
  const Api& a = api();
  int major = 0, minor = 0, dev = 0;
  check(a.cuDeviceGet(&dev, device), "cuDeviceGet");
  check(a.cuDeviceGetAttribute(&major, kComputeCapabilityMajor, dev), "cuDeviceGetAttribute");
  check(a.cuDeviceGetAttribute(&minor, kComputeCapabilityMinor, dev), "cuDeviceGetAttribute");
  return "sm_" + std::to_string(major) + std::to_string(minor);
}

std::string nvrtc_version() {
  const Api& a = nvrtc_api();
  int major = 0, minor = 0;
  if (a.nvrtcVersion(&major, &minor) != 0) throw Error("nvrtcVersion failed");
  return std::to_string(major) + "." + std::to_string(minor);
}

namespace {

// NVRTC compiles at most compile_threads() programs at once in the process: code generation's threads and
// deferred kernels' own (cuda_kernel.h) share them, so that a model's many background compiles neither
// outnumber the cores nor hold each its own NVRTC memory at once. A slot is held for the scope.
class NvrtcSlot {
 public:
  NvrtcSlot() {
    std::unique_lock<std::mutex> lock(mu());
    freed().wait(lock, [] { return busy() < compile_threads(); });
    ++busy();
  }
  ~NvrtcSlot() {
    std::lock_guard<std::mutex> lock(mu());
    --busy();
    freed().notify_one();
  }
  NvrtcSlot(const NvrtcSlot&) = delete;
  NvrtcSlot& operator=(const NvrtcSlot&) = delete;

 private:
  // Never destroyed: a background compile may end during exit.
  static std::mutex& mu() { static auto* m = new std::mutex; return *m; }
  static std::condition_variable& freed() { static auto* c = new std::condition_variable; return *c; }
  static size_t& busy() { static size_t n = 0; return n; }
};

// NVRTC: source -> cubin for `arch`. Throws ember::Error with NVRTC's log on failure.
std::string nvrtc_compile(const std::string& source, const std::string& name, const std::string& arch) {
  NvrtcSlot slot;
  const Api& a = nvrtc_api();
  nvrtcProgram prog = nullptr;
  if (a.nvrtcCreateProgram(&prog, source.c_str(), (name + ".cu").c_str(), 0, nullptr, nullptr) != 0)
    throw Error("NVRTC: cannot create program " + name);
  std::string arch_option = "--gpu-architecture=" + arch;
  std::vector<const char*> options{arch_option.c_str(), "--std=c++17"};
  nvrtcResult r = a.nvrtcCompileProgram(prog, static_cast<int>(options.size()), options.data());
  if (r != 0) {
    size_t n = 0;
    a.nvrtcGetProgramLogSize(prog, &n);
    std::string log(n, '\0');
    a.nvrtcGetProgramLog(prog, log.data());
    a.nvrtcDestroyProgram(&prog);
    throw Error("NVRTC failed to compile " + name + ": " + a.nvrtcGetErrorString(r) + "\n" + log);
  }
  size_t size = 0;
  a.nvrtcGetCUBINSize(prog, &size);
  std::string cubin(size, '\0');
  a.nvrtcGetCUBIN(prog, cubin.data());
  a.nvrtcDestroyProgram(&prog);
  return cubin;
}

// The functions `names` of a loaded module, in order.
std::vector<void*> entry_points(void* module, const std::vector<std::string>& names) {
  std::vector<void*> out;
  for (const std::string& name : names) {
    void* function = nullptr;
    check(api().cuModuleGetFunction(&function, module, name.c_str()), "cuModuleGetFunction");
    out.push_back(function);
  }
  return out;
}

// The warm-up's program: the prelude every module starts with and a kernel calling the math library
// (libdevice), the warp shuffles and 16-bit conversions that generated kernels use, so that what NVRTC
// loads or initializes on first use is done before the first real module.
std::string warm_up_source() {
  return std::string(kPrelude) + R"(
extern "C" __global__ void ember_warm_up(const unsigned short* a, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  float x = i < n ? bf2f(a[i]) + h2f(a[i]) : 0.f;
  float y = expf(x) + logf(fabsf(x) + 1e-8f) + tanhf(x) + erff(x) + rsqrtf(x * x + 1.f) + powf(x, 3.f);
  y = warp_reduce<0>(y) + warp_reduce<1>(y);
  if (i < n) out[i] = bf2f(f2bf(y)) + h2f(f2h(y));
}
)";
}

}  // namespace

void warm_up_async() {
  std::lock_guard<std::mutex> lock(warm_mu);
  if (warm_up_future().valid()) return;
  warm_up_future() = std::async(std::launch::async, [] {
    try {
      api();
      nvrtc_api();
      // A program of its own (never cached): what the first compile in a process pays beyond its source.
      nvrtc_compile(warm_up_source(), "ember_warm_up", arch(0));
    } catch (const std::exception&) {  // no driver or NVRTC: the real compile reports it
    }
  }).share();
}

namespace {

// One compiled and loaded module. The process cache keeps each image next to its module, so a store
// handed in later (an export after the same kernel was compiled by torch.compile) still receives it.
struct Loaded {
  void* module = nullptr;
  KernelImage image;
};

// The calling thread's CPU time, page faults and involuntary context switches so far. Beside NVRTC's wall
// time they tell a compile that computed from one that waited: for a core, or for its library's pages.
struct ThreadUsage {
  double cpu_ms = 0;
  long major_faults = 0, minor_faults = 0, preemptions = 0;
};
ThreadUsage thread_usage() {
  rusage u{};
  if (getrusage(RUSAGE_THREAD, &u) != 0) return {};
  auto ms = [](const timeval& t) { return t.tv_sec * 1e3 + t.tv_usec / 1e3; };
  return {ms(u.ru_utime) + ms(u.ru_stime), u.ru_majflt, u.ru_minflt, u.ru_nivcsw};
}

// The image for `source`: from `images`, the disk cache, or NVRTC (then stored in the disk cache).
KernelImage find_or_compile(const std::string& source, const std::string& name, const std::string& target,
                            ImageStore* images) {
  if (const KernelImage* stored = images ? images->find(target, source) : nullptr) return *stored;
  const std::string version = nvrtc_version();  // throws where NVRTC is missing, as compiling would
  const std::string dir = disk_cache_dir();
  if (std::optional<KernelImage> cached = disk_cache_find(dir, target, version, source)) {
    std::lock_guard<std::mutex> lock(stats_mu);
    ++stats.from_cache;
    return std::move(*cached);
  }
  wait_for_warm_up();  // only a compile does: a process whose kernels all come from a cache never waits for it
  auto t0 = std::chrono::steady_clock::now();
  const ThreadUsage u0 = thread_usage();
  KernelImage image{target, source, nvrtc_compile(source, name, target), version};
  const ThreadUsage u1 = thread_usage();
  {
    std::lock_guard<std::mutex> lock(stats_mu);
    stats.nvrtc_ms += ms_since(t0);
    stats.nvrtc_cpu_ms += u1.cpu_ms - u0.cpu_ms;
    stats.nvrtc_major_faults += u1.major_faults - u0.major_faults;
    stats.nvrtc_minor_faults += u1.minor_faults - u0.minor_faults;
    stats.nvrtc_preemptions += u1.preemptions - u0.preemptions;
    ++stats.compiled;
  }
  disk_cache_store(dir, image);
  return image;
}

// The process's modules, keyed by architecture and source. The first caller of a key compiles it, outside
// the lock, so distinct groups compile at once (generate.cpp starts them in parallel); a caller of the same
// key meanwhile waits for that result instead of compiling it again (BERT's 39 groups are 4 distinct sources).
struct ModuleCache {
  std::mutex mu;
  std::unordered_map<std::string, std::shared_future<std::shared_ptr<const Loaded>>> modules;
};
ModuleCache& module_cache() {
  static ModuleCache* cache = new ModuleCache;  // never destroyed: background compiles may finish during exit
  return *cache;
}

}  // namespace

bool has_image(const std::string& source, int device) {
  const std::string target = arch(device);
  {
    ModuleCache& c = module_cache();
    std::lock_guard<std::mutex> lock(c.mu);
    // Only a loaded module: one still compiling would make the caller wait for it.
    auto it = c.modules.find(target + "\n" + source);
    if (it != c.modules.end() && it->second.wait_for(std::chrono::seconds(0)) == std::future_status::ready) return true;
  }
  const std::string version = nvrtc_version();
  const std::string dir = disk_cache_dir();
  return !dir.empty() && disk_cache_find(dir, target, version, source).has_value();
}

std::vector<void*> compile(const std::string& source, const std::vector<std::string>& names, int device,
                           ImageStore* images, bool arch_specific) {
  ModuleCache& c = module_cache();
  std::mutex& mu = c.mu;
  auto& cache = c.modules;
  if (names.empty()) throw Error("CUDA: a module needs at least one entry point");
  const Api& a = api();
  make_current(device);
  const std::string target = arch(device) + (arch_specific ? "a" : "");
  std::string key = target + "\n" + source;
  std::promise<std::shared_ptr<const Loaded>> promise;
  std::shared_future<std::shared_ptr<const Loaded>> pending;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto [it, first] = cache.try_emplace(key);
    if (first) it->second = promise.get_future().share();
    else pending = it->second;
  }
  if (pending.valid()) {  // compiled, or being compiled, by another caller; rethrows its failure
    std::shared_ptr<const Loaded> loaded = pending.get();
    if (images && !images->find(target, source)) images->add(loaded->image);
    return entry_points(loaded->module, names);
  }
  try {
    auto loaded = std::make_shared<Loaded>();
    loaded->image = find_or_compile(source, names.front(), target, images);
    if (images) images->add(loaded->image);
    auto t_load = std::chrono::steady_clock::now();
    check(a.cuModuleLoadData(&loaded->module, loaded->image.image.data()), "cuModuleLoadData");
    {
      std::lock_guard<std::mutex> lock(stats_mu);
      stats.load_ms += ms_since(t_load);
    }
    std::vector<void*> functions = entry_points(loaded->module, names);
    promise.set_value(std::move(loaded));
    return functions;
  } catch (...) {
    // The callers waiting now get this failure; later ones try again.
    {
      std::lock_guard<std::mutex> lock(mu);
      cache.erase(key);
    }
    promise.set_exception(std::current_exception());
    throw;
  }
}

void* compile(const std::string& source, const std::string& name, int device, ImageStore* images) {
  return compile(source, std::vector<std::string>{name}, device, images).front();
}

std::vector<void*> load_image(const void* image, const std::vector<std::string>& names, int device) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, void*> modules;
  const Api& a = api();
  make_current(device);
  std::lock_guard<std::mutex> lock(mu);
  void*& module = modules[{image, device}];
  if (!module) check(a.cuModuleLoadData(&module, image), "cuModuleLoadData");
  return entry_points(module, names);
}

int multiprocessor_count(int device) {
  static std::mutex mu;
  static std::unordered_map<int, int> counts;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = counts.find(device); it != counts.end()) return it->second;
  const Api& a = api();
  int dev = 0, count = 0;
  check(a.cuDeviceGet(&dev, device), "cuDeviceGet");
  check(a.cuDeviceGetAttribute(&count, kMultiprocessorCount, dev), "cuDeviceGetAttribute");
  return counts[device] = std::max(count, 1);
}

int max_shared_memory_optin(int device) {
  const Api& a = api();
  int dev = 0, bytes = 0;
  check(a.cuDeviceGet(&dev, device), "cuDeviceGet");
  check(a.cuDeviceGetAttribute(&bytes, kMaxSharedMemoryPerBlockOptin, dev), "cuDeviceGetAttribute");
  return bytes;
}

void set_max_dynamic_shared_memory(void* function, int bytes) {
  // Only ever raised: steps that share an entry point (one image's kernels are loaded once per device) each
  // ask for their own size, and lowering the limit to a later step's smaller size made an earlier step's next
  // launch fail with "invalid argument" (two linear chains of a forward and its backward, fuzz seed 708770).
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  int allowed = 0;
  check(api().cuFuncGetAttribute(&allowed, kFunctionMaxDynamicSharedSizeBytes, function), "cuFuncGetAttribute");
  if (allowed >= bytes) return;
  check(api().cuFuncSetAttribute(function, kFunctionMaxDynamicSharedSizeBytes, bytes), "cuFuncSetAttribute");
}

int max_threads_per_block(void* function) {
  int threads = 0;
  check(api().cuFuncGetAttribute(&threads, kFunctionMaxThreadsPerBlock, function), "cuFuncGetAttribute");
  return threads;
}

int resident_blocks(void* function, int threads) {
  int blocks = 0;
  check(api().cuOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, function, threads, 0),
        "cuOccupancyMaxActiveBlocksPerMultiprocessor");
  return blocks;
}

bool tile_map_16bit(void* map, const void* data, const uint64_t* dims, const uint64_t* strides) {
  const Api& a = api();
  if (!a.cuTensorMapEncodeTiled) return false;
  constexpr int kUint16 = 1, kInterleaveNone = 0, kSwizzle128B = 3, kL2Promotion128B = 2, kOobFillZeros = 0;
  const unsigned box[4] = {64, 64, 1, 1}, element_strides[4] = {1, 1, 1, 1};
  return a.cuTensorMapEncodeTiled(map, kUint16, 4, const_cast<void*>(data), dims, strides, box, element_strides,
                                  kInterleaveNone, kSwizzle128B, kL2Promotion128B, kOobFillZeros) == 0;
}

void launch(void* function, unsigned blocks, unsigned threads, void* stream, void* params, int device, unsigned blocks_y,
            unsigned shared_bytes) {
  make_current(device);
  void* args[] = {params};
  const CUresult r = api().cuLaunchKernel(function, blocks, blocks_y, 1, threads, 1, 1, shared_bytes, stream, args, nullptr);
  if (r != 0) {
    const std::string what = "cuLaunchKernel (" + std::to_string(blocks) + " x " + std::to_string(blocks_y) +
                             " blocks of " + std::to_string(threads) + " threads, " + std::to_string(shared_bytes) +
                             " bytes of dynamic shared memory)";
    check(r, what.c_str());
  }
}

namespace {
// Each device's primary context, retained once (the runtime holds it for the process anyway).
void* primary_context(int device) {
  static std::atomic<void*> primary[64] = {};
  if (device < 0 || device >= 64) throw Error("CUDA device index " + std::to_string(device) + " out of range");
  void* ctx = primary[device].load(std::memory_order_acquire);
  if (ctx) return ctx;
  const Api& a = api();
  int dev = 0;
  check(a.cuDeviceGet(&dev, device), "cuDeviceGet");
  check(a.cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  void* expected = nullptr;
  if (!primary[device].compare_exchange_strong(expected, ctx)) return expected;  // another thread's: the same one
  return ctx;
}
}  // namespace

bool is_current(int device) {
  void* ctx = primary_context(device);
  void* current = nullptr;
  return api().cuCtxGetCurrent(&current) == 0 && current == ctx;
}

bool capturing(void* stream) {
  int status = 0;  // CU_STREAM_CAPTURE_STATUS_NONE
  check(api().cuStreamIsCapturing(stream, &status), "cuStreamIsCapturing");
  return status != 0;
}

void launch_graph(void* exec, void* stream, int device) {
  make_current(device);  // a thread new to CUDA has no current context, where the runtime would make one
  check(api().cuGraphLaunch(exec, stream), "cuGraphLaunch");
}

}  // namespace ember::cuda
