// A tuned GEMM choice on disk (kernels/cuda/gemm.cpp): one file per problem under <cache dir>/gemm, named by the
// XXH64 of its key, so that a restarted process reuses what an earlier one timed instead of timing again.
//  1. The key is text naming everything the choice depends on (gemm.cpp writes it: the problem, the device, the
//     cuBLASLt and ember versions, the tuning level); a record is trusted only where its key is exactly the one
//     asked for and its checksum holds. A short, damaged, foreign or other-layout file is a miss, never an error.
//  2. Nothing here needs CUDA: a cuBLASLt algorithm is 64 opaque bytes, whose meaning gemm.cpp checks before
//     using it (cublasLtMatmulAlgoCheck against the step's descriptors, the route and kernel configuration
//     against what the step can run). So the reader is fuzzed without a GPU (test/cpp/gemm_record_test.cpp).
//  3. Writes go through a temporary file and a rename (disk_cache.h); failing to write costs nothing but a
//     timing in the next process.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace ember::cuda {

struct GemmRecord {
  std::string key;
  uint8_t route = 0;                 // gemm.cpp's Route
  int32_t config = 0;                // Route::Kernel: the kernel configuration
  uint64_t workspace = 0;            // cuBLASLt routes: the algorithm's workspace bytes
  std::array<uint8_t, 64> algo{};    // cuBLASLt routes: the cublasLtMatmulAlgo_t
  std::string winner;                // its name among the candidates
  // What each candidate took, for ember.explain: its name and milliseconds (negative: it could not run).
  std::vector<std::pair<std::string, float>> timings;
};

// The file's bytes for `record`, and the record those bytes hold where they are a whole, undamaged record of
// exactly `key` (nullopt for anything else).
std::string gemm_record_bytes(const GemmRecord& record);
std::optional<GemmRecord> parse_gemm_record(const std::string& bytes, const std::string& key);

// The record of `key` under `cache_dir` (disk_cache_dir(); "" finds nothing), and writing one there (best
// effort: false where it could not).
std::optional<GemmRecord> gemm_record_find(const std::string& cache_dir, const std::string& key);
bool gemm_record_store(const std::string& cache_dir, const GemmRecord& record);

// What the GEMM fast paths' tuning has done in this process (ember._C.gemm_tuning_stats; tests check that a
// warm start times nothing): problems timed at the default level and exhaustively (mode="max-autotune"),
// choices read from disk, records found but refused (a failed algorithm check, a route the step cannot run),
// and problems that got the default's choice because the graph's autotuning budget was spent.
struct GemmTuningCounters {
  std::atomic<uint64_t> timed{0}, autotuned{0}, from_disk{0}, refused{0}, over_budget{0};
};
GemmTuningCounters& gemm_tuning_counters();

}  // namespace ember::cuda
