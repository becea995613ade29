// NVRTC compilation and kernel launches through the CUDA driver API, loaded lazily (see driver.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ember::cuda {

class ImageStore;

// True when the driver loads; otherwise false with the reason. NVRTC is loaded alongside when it is
// found, and needed only for kernels that no image store holds.
bool available(std::string* why_not);

// Starts loading the driver and NVRTC and compiling a small program (the prelude, math functions) on a
// thread of its own, so that NVRTC's first-use cost in the process (loading its libraries, its first
// compile) overlaps the tracing that precedes a graph's code generation; compile() waits for it. Returns
// at once; repeated calls do nothing.
void warm_up_async();

// Process-wide totals of compile work (milliseconds; NVRTC summed over threads). NVRTC's CPU time, page
// faults and involuntary context switches, beside its wall time, say whether a slow compile computed or
// waited.
struct CompileStats {
  double nvrtc_ms = 0, nvrtc_cpu_ms = 0, load_ms = 0;
  long nvrtc_major_faults = 0, nvrtc_minor_faults = 0, nvrtc_preemptions = 0;
  int compiled = 0, from_cache = 0;
  int background = 0;  // modules handed to a background compile (cuda_kernel.h)
};
CompileStats compile_stats();
// Counts one module handed to a background compile in CompileStats::background.
void count_background_compile();

// `device`'s architecture as NVRTC names it: "sm_90".
std::string arch(int device);
// The NVRTC version, "13.0"; throws ember::Error where NVRTC is not found.
std::string nvrtc_version();

// Returns the CUfunction named `name` in `source` compiled for `device`'s architecture: the image from
// `images` where it holds one, else compiled with NVRTC (and added to `images`, when given). Identical
// sources compile once per process. Throws ember::Error with NVRTC's log on failure.
void* compile(const std::string& source, const std::string& name, int device, ImageStore* images = nullptr);
// The same for a module with several entry points: one CUfunction per name, in order. `arch_specific`
// compiles for the architecture's own features ("sm_90a": wgmma), which no later architecture runs.
std::vector<void*> compile(const std::string& source, const std::vector<std::string>& names, int device,
                           ImageStore* images = nullptr, bool arch_specific = false);

// Whether compile() would find `source`'s image for `device` without NVRTC and without waiting: the process
// has loaded the module, or the disk cache holds its image.
bool has_image(const std::string& source, int device);

// The functions `names` of a module image built ahead of time (a cubin or fatbin in memory that outlives
// the process, such as kernels/cuda/gemm_image.cpp's), loaded once per device.
std::vector<void*> load_image(const void* image, const std::vector<std::string>& names, int device);

// The largest block `function` launches with (its registers per thread bound it below 1024).
int max_threads_per_block(void* function);

// Blocks of `threads` threads of `function` that one multiprocessor holds at once (its registers and
// static shared memory bound it); 0 where the block is too large for the function.
int resident_blocks(void* function, int threads);

// `device`'s multiprocessor count, queried once per device.
int multiprocessor_count(int device);

// The most shared memory one block of a kernel may use on `device` once the kernel allows it (bytes).
int max_shared_memory_optin(int device);
// Allows `function` at least `bytes` of dynamic shared memory per block (beyond the default 48 KB); never
// lowers what an earlier call allowed the same function.
void set_max_dynamic_shared_memory(void* function, int bytes);

// Fills `map` (a CUtensorMap: 128 bytes, 64-byte aligned) for TMA loads of a 4-D tensor of 16-bit values at
// `data` (16-byte aligned) in boxes of 64 x 64 (innermost dimension x the next) written to shared memory in
// the 128-byte swizzle; out-of-bounds elements load as zeros. `dims` innermost first, `strides` the bytes
// between steps of dimensions 1 to 3 (multiples of 16). False where the driver has no TMA or rejects the
// tensor.
bool tile_map_16bit(void* map, const void* data, const uint64_t* dims, const uint64_t* strides);

// Launches `function` with one by-value struct argument `params` on `stream` (a CUstream), on a grid of
// blocks x blocks_y, with `shared_bytes` of dynamic shared memory per block.
void launch(void* function, unsigned blocks, unsigned threads, void* stream, void* params, int device, unsigned blocks_y = 1,
            unsigned shared_bytes = 0);

// True when `device`'s primary context (the one the CUDA runtime and ATen use) is current on this thread,
// so that the runtime's current device is `device`: one thread-local read, where asking the runtime for the
// current device costs a replayed call ~0.3 us.
bool is_current(int device);

// Whether work on `stream` (a CUstream) is being captured into a CUDA graph.
bool capturing(void* stream);

// Launches an instantiated CUDA graph (a cudaGraphExec_t) on `stream` (a CUstream of `device`) through the
// driver API (cudagraph/replay.cpp: a replayed call's launch), with `device`'s primary context made current
// where no context is (a thread new to CUDA). The caller has made `device` the current device.
void launch_graph(void* exec, void* stream, int device);

}  // namespace ember::cuda
