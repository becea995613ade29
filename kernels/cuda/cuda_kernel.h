// A fusion group's CUDA kernel: its Program printed as CUDA C++ (cuda_source.h), compiled with NVRTC.
#pragma once

#include "ember/runtime.h"
#include "kernels/program.h"

#include <functional>
#include <future>
#include <memory>
#include <string>

namespace ember::cuda {

class ImageStore;

// The group's kernel, or null with the reason where the CUDA driver cannot be loaded; the source is appended
// to *listing. Its image comes from `images` (may be null), the process or the disk cache where they hold it,
// and is compiled now so. Otherwise the kernel is deferred: NVRTC compiles it on a thread of its own, and until it is loaded Kernel::compiling() is true, so that the plan
// runs the group's ATen ops in its place (Step::stand_in): a first call does not wait for NVRTC. A call
// being captured into a CUDA graph, or one without a stand-in, waits for the compile.
// EMBER_CUDA_BACKGROUND=0 compiles every kernel now. Under exhaustive `tuning` (max-autotune) the kernel compiles
// now and times each call shape's launch at its first call (launch_tuning.h).
std::shared_ptr<const Kernel> make_fused_kernel(Program program, std::string* listing, std::string* why_not,
                                                ImageStore* images, const Tuning& tuning = {});

// Waits until every deferred kernel's compile (above) has finished: then calls run the kernels they will
// keep running (bench/ times steady state after this).
void wait_for_background_compiles();

// Whether modules no cache holds compile on a thread of their own (EMBER_CUDA_BACKGROUND, default on; read
// when a plan is built, never per call).
bool background_compiles();

// Runs `compile` on a thread of its own, counted among the compiles wait_for_background_compiles() and the
// process's exit wait for; its future. `compile` keeps its own failures (what it throws is dropped).
std::shared_future<void> start_background_compile(std::function<void()> compile);

}  // namespace ember::cuda
