// The CUDA C++ printed for a fusion group's Program: one NVRTC module with several entry points, so
// the launcher can pick, per call and without recompiling, the fastest one the call's pointers and
// shapes allow. Callable without a CUDA device (the nvcc check in test/cpp/fusion_test.cpp uses it).
#pragma once

#include "kernels/program.h"

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace ember::cuda {

// How a row group (reductions over the last dimension) maps rows onto threads.
//  General: one block per row, every pass re-reads the row from global memory (any length).
//  Warp:    one warp per row, several rows per block; each lane keeps `per_thread` values of every
//           full input in registers, so the row is read once (short rows).
//  Block:   one block per row, each thread keeps `per_thread` values per full input (rows up to a few
//           thousand columns).
struct RowVariant {
  enum class Mode : uint8_t { General, Warp, Block } mode = Mode::General;
  int chunks = 0;  // vectors of `vector_width` elements each thread holds; per_thread = chunks * width
  std::string entry;
};

struct CudaSource {
  std::string text;          // the module: the general entry, the vector entry or the row variants
  std::string strided_text;  // flat groups: the module of the strided vector entry alone (compiled lazily)
  // Where the module has entries besides the general one: `text` split into the general entry's module
  // and the others', which NVRTC compiles at the same time on two threads (its time is mostly ptxas
  // optimizing each entry; a pointwise group's two entries took ~0.5 s together on this project's
  // 2-core machine).
  std::string general_text, entries_text;
  std::string general;       // the strided kernel: flat groups, General rows, or column groups' only entry
  int column_reductions = 0;  // column groups: reductions, each with a workspace row per chunk of rows
  std::string vector_entry;  // flat groups: 16-byte vector loads/stores with a scalar tail; else empty
  // The same where some input is read through its strides (its loop carries index arithmetic, and
  // the registers it needs, that the vector entry does without).
  std::string strided_vector_entry;
  int vector_width = 1;      // elements per 16-byte (at most) access, shared by every tensor of the group
  int flat_unroll = 1;       // vectors each thread of the vector entries takes per iteration
  std::vector<RowVariant> rows;  // row groups: the register-resident variants compiled (General excluded)
  // Flat groups whose outputs are dense in another order than row-major (channels_last): the logical
  // dimension iterated at each position, outermost in memory first (call_plan.cpp); else empty.
  std::vector<int> iteration_order;
  // Flat groups: bit k set where the vector entries can read input k by channel (p.chan); the call
  // plan sets p.chan only within it.
  uint32_t channel_inputs = 0;
  // Flat groups: bit k set where they can read input k as a repeating period (p.inner).
  uint32_t repeat_inputs = 0;
};

// Prints `program` with its entry points named `name`, `name`_vec, `name`_vec_strided, `name`_w<chunks>,
// `name`_b<chunks>.
CudaSource generate(const Program& program, const std::string& name);

// The source text alone (generate(...).text).
std::string generate_source(const Program& program, const std::string& name);

// The register-resident variant a row of `cols` columns runs with, among `compiled` (and, where given,
// those `launchable` accepts); nullopt for the general one-block-per-row kernel (rows too long, or no
// variant compiled or launchable for them). Preference: a warp per row, then a block per row, each
// with the fewest columns per thread.
std::optional<RowVariant> choose_row_variant(int64_t cols, int vector_width, const std::vector<RowVariant>& compiled,
                                             const std::function<bool(const RowVariant&)>& launchable = {});

// Threads of a block-per-row launch of `v` over rows of `cols` columns.
int64_t block_threads(const RowVariant& v, int64_t cols, int vector_width);

// Params' `vec` word: bit k (k < 31) says input k is read with vector loads, bit 31 that full outputs
// are written with vector stores. Its `bcast` word: bit k says input k is one value for every element.
// Its `inner` word (flat groups): bit k says input k repeats every period[k] elements, contiguous and
// aligned within a period (a bias over the last dimensions), read with vector loads.
constexpr int kMaxVectorInputs = 31;

// Threads of a column group's block (Program::outer): 32 columns by 8 row lanes. The kernel is printed
// for this block size.
constexpr unsigned kColumnThreads = 256;
constexpr uint32_t kVectorOutputs = 1u << 31;

}  // namespace ember::cuda
