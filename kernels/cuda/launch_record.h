// A timed launch of a fused CUDA kernel on disk (launch_tuning.h): one file per kernel source, device and call
// shape under <cache dir>/launch, named by the XXH64 of its key, so that a restarted process with the same cache
// folder launches as an earlier one timed instead of timing again.
//  1. The key is text naming what the choice depends on (launch_tuning.cpp writes it: ember's version, the device,
//     the source's hash, the call's sizes and access masks and plan_call's entry); a record is trusted only where
//     its key is exactly the one asked for and its checksum holds. A short, damaged or foreign file is a miss.
//  2. What a record holds is only ever used where it is one of the call's own launch_candidates (call_plan.h), so
//     a record that parses but means nothing here is refused, never launched. The reader needs no GPU and is
//     fuzzed (test/cpp/launch_tuning_test.cpp).
//  3. Written through a temporary file and a rename (disk_cache.h), best effort.
#pragma once

#include "kernels/cuda/call_plan.h"

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace ember::cuda {

struct LaunchRecord {
  std::string key;
  LaunchChoice choice;
  std::string winner;  // its name (launch_name)
  // What each candidate took, for ember.explain: its name and milliseconds (negative: it could not run).
  std::vector<std::pair<std::string, float>> timings;
};

// The file's bytes for `record`, and the record those bytes hold where they are a whole, undamaged record of
// exactly `key` (nullopt for anything else).
std::string launch_record_bytes(const LaunchRecord& record);
std::optional<LaunchRecord> parse_launch_record(const std::string& bytes, const std::string& key);

// The record of `key` under `cache_dir` ("" finds nothing), and writing one there (false where it could not).
std::optional<LaunchRecord> launch_record_find(const std::string& cache_dir, const std::string& key);
bool launch_record_store(const std::string& cache_dir, const LaunchRecord& record);

// What max-autotune's launch tuning of fused kernels has done in this process (ember._C.launch_tuning_stats;
// tests check that a warm start times nothing): call shapes timed, choices read from disk, records found but
// refused (not a candidate of the call), and shapes that kept plan_call's launch because the graph's budget was
// spent.
struct LaunchTuningCounters {
  std::atomic<uint64_t> timed{0}, from_disk{0}, refused{0}, over_budget{0};
};
LaunchTuningCounters& launch_tuning_counters();

}  // namespace ember::cuda
