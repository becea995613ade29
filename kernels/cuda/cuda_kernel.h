// A fusion group's CUDA kernel: its Program printed as CUDA C++ (cuda_source.h), compiled with NVRTC.
#pragma once

#include "ember/runtime.h"
#include "kernels/program.h"

#include <memory>
#include <string>

namespace ember::cuda {

class ImageStore;

// Compiles the group's kernel now (so the first call does not wait later), or loads its image from
// `images` (may be null). Null, with the reason, where the CUDA driver cannot be loaded; the source is
// appended to *listing.
std::shared_ptr<const Kernel> make_fused_kernel(Program program, std::string* listing, std::string* why_not,
                                                ImageStore* images);

}  // namespace ember::cuda
