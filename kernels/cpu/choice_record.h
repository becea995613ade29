// A timed CPU choice on disk: which library runs a CPU matmul problem (matmul_kernel.cpp, point 5) and how many
// threads a fused CPU kernel takes under max-autotune (thread_tuning.h). One file per choice under
// <cache dir>/cpu, named by the XXH64 of its key, so that a restarted process reuses what an earlier one timed.
//  1. The key is text naming what the choice depends on: choice_record_host() (ember's version and build, the
//     CPU's model and ATen's thread count), then the problem as its user writes it. A record is trusted only where
//     its key is exactly the one asked for and its checksum holds; a short, damaged or foreign file is a miss.
//  2. A record holds a number (the library, the thread cap) that its user checks against what the call can run
//     before using it, and the candidates' times for ember.explain. The reader is fuzzed
//     (test/cpp/choice_record_test.cpp).
//  3. Written through a temporary file and a rename (kernels/cuda/disk_cache.h, which needs no GPU), best effort:
//     a failed write costs the next process a timing.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace ember::cpu {

struct ChoiceRecord {
  std::string key;
  int64_t choice = 0;
  // What each candidate took: its name and milliseconds.
  std::vector<std::pair<std::string, float>> timings;
};

// The first line of every key: ember's version and build, the CPU's model name and ATen's thread count now.
std::string choice_record_host();

// The file's bytes for `record`, and the record those bytes hold where they are a whole, undamaged record of
// exactly `key` (nullopt for anything else).
std::string choice_record_bytes(const ChoiceRecord& record);
std::optional<ChoiceRecord> parse_choice_record(const std::string& bytes, const std::string& key);

// The record of `key` under the cache directory (ember.config.cache_dir; none where it is off), and writing one
// there (false where it could not).
std::optional<ChoiceRecord> choice_record_find(const std::string& key);
bool choice_record_store(const ChoiceRecord& record);

// What the CPU timings did in this process (ember._C.cpu_tuning_stats; tests check that a warm start times
// nothing): problems timed, choices read from disk, and records found but refused (a choice the call cannot run).
struct CpuTuningCounters {
  std::atomic<uint64_t> timed{0}, from_disk{0}, refused{0};
};
CpuTuningCounters& cpu_tuning_counters();

}  // namespace ember::cpu
