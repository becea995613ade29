// A fusion group's CUDA kernel: its Program printed as CUDA C++ (cuda_source.h), compiled with NVRTC.
#pragma once

#include "ember/runtime.h"
#include "kernels/program.h"

#include <memory>
#include <string>

namespace ember::cuda {

class ImageStore;

// Compiles the group's kernel now, or loads its image from `images` (may be null). Null, with the reason,
// where the CUDA driver cannot be loaded; the source is appended to *listing.
//
// Where the group's row entries are a module apart from its general entry and cost several times its
// NVRTC time (CudaSource::entries_in_background), and neither `images`, the process nor the disk cache
// has that module, only the general entry (a block per row, any strides) compiles now. The other module
// compiles on a thread of its own, and calls take its entries once it is loaded; until then they run the
// general entry, except that a call being captured into a CUDA graph waits for it.
// EMBER_CUDA_BACKGROUND=0 compiles both now.
std::shared_ptr<const Kernel> make_fused_kernel(Program program, std::string* listing, std::string* why_not,
                                                ImageStore* images);

// Waits until every kernel's background compile (above) has finished: then calls run the entries they
// will keep running (bench/ times steady state after this).
void wait_for_background_compiles();

}  // namespace ember::cuda
