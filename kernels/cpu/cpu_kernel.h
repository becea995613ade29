// The CPU kernel generators: a fusion group's Program becomes a vectorized interpreter kernel; a claimed
// matmul group becomes a oneDNN matmul.
#pragma once

#include "ember/runtime.h"
#include "kernels/epilogue_group.h"
#include "kernels/program.h"

#include <memory>
#include <string>
#include <vector>

namespace ember::cpu {

// Null (with the reason in *why_not) when this CPU cannot run it. Picks the widest instruction set. Under
// `tuning.exhaustive` (max-autotune) each call shape's thread count is timed at its first call (thread_tuning.h).
std::shared_ptr<const Kernel> make_fused_kernel(Program program, std::string* why_not, const Tuning& tuning);

// A claimed matmul group as one oneDNN matmul with post-ops (kernels/cpu/matmul_kernel.cpp). Null, with the
// reason in *why_not, when ember was built without oneDNN or oneDNN rejects it.
// `exhaustive` (max-autotune): every problem's library is timed, not only those of kTimedMacs and more.
std::shared_ptr<const Kernel> make_matmul_kernel(const EpilogueGroup& group, std::string* why_not,
                                                bool exhaustive = false);
// One line per problem the matmul kernels timed, in order: "72x232x264 matmul f32 +bias gelu (packed): onednn
// 41 us, aten 48 us, torch 45 us -> onednn". A problem is timed once per process, or read from <cache_dir>/cpu
// where an earlier process timed it (its line then ends "(from disk)"); tests read which ran.
std::vector<std::string> cpu_matmul_timings();
// The same for a claimed 2-D convolution group (kernels/cpu/conv_kernel.cpp).
std::shared_ptr<const Kernel> make_conv2d_kernel(const EpilogueGroup& group, std::string* why_not);
// An ember::fold_batchnorm node (passes/fold_batchnorm.cpp) that caches the folded weights and bias while
// its inputs are unchanged (kernels/cpu/fold_batchnorm_kernel.cpp); it reads the node's tensor arguments in order.
std::shared_ptr<const Kernel> make_fold_batchnorm_kernel(const Node& fold, std::string* why_not);

}  // namespace ember::cpu
