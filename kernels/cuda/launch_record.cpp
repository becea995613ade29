// Record file: "EMBERLCH", u32 layout version, the key (u64 length, bytes), u32 entry, threads, blocks and splits,
// the winner's name (u64 length, bytes), u32 candidate count and per candidate its name (u64 length, bytes) and
// f32 milliseconds, then the XXH64 of everything before it; little-endian as the host writes it (the key names
// the device).
#include "kernels/cuda/launch_record.h"

#include "kernels/cuda/disk_cache.h"
#include "kernels/cuda/record_io.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace ember::cuda {
namespace {

using namespace record_io;

constexpr char kMagic[8] = {'E', 'M', 'B', 'E', 'R', 'L', 'C', 'H'};
constexpr uint32_t kLayoutVersion = 1;
constexpr uint32_t kMaxTimings = 1024;   // far above any call's candidates
constexpr uint64_t kMaxNameBytes = 64;   // a candidate's name

}  // namespace

std::string launch_record_bytes(const LaunchRecord& r) {
  std::string out(kMagic, sizeof(kMagic));
  put(out, kLayoutVersion);
  put_string(out, r.key);
  put(out, r.choice.entry);
  put(out, r.choice.threads);
  put(out, r.choice.blocks);
  put(out, r.choice.splits);
  put_string(out, clipped(r.winner, kMaxNameBytes));
  put_timings(out, r.timings, kMaxTimings, kMaxNameBytes);
  put(out, checksum(out, out.size()));
  return out;
}

std::optional<LaunchRecord> parse_launch_record(const std::string& bytes, const std::string& key) {
  const size_t body = checked_body(bytes, kMagic);
  if (body == 0) return std::nullopt;
  Reader in(bytes, body);
  char magic[sizeof(kMagic)];
  uint32_t version = 0;
  LaunchRecord r;
  if (!in.get(&magic) || !in.get(&version) || version != kLayoutVersion || !in.get_string(&r.key, body) ||
      r.key != key || !in.get(&r.choice.entry) || !in.get(&r.choice.threads) || !in.get(&r.choice.blocks) ||
      !in.get(&r.choice.splits) || !in.get_string(&r.winner, kMaxNameBytes))
    return std::nullopt;
  // Values no launch takes are damage (the caller also checks that the choice is one of the call's candidates).
  if (r.choice.threads < 32 || r.choice.threads > 1024 || r.choice.blocks == 0 || r.choice.splits == 0 ||
      r.choice.splits > 65535)
    return std::nullopt;
  if (!get_timings(in, &r.timings, kMaxTimings, kMaxNameBytes) || !in.done()) return std::nullopt;
  return r;
}

std::optional<LaunchRecord> launch_record_find(const std::string& cache_dir, const std::string& key) {
  if (cache_dir.empty()) return std::nullopt;
  const std::optional<std::string> bytes = read_cache_file(cache_dir + "/launch/" + file_name(key));
  return bytes ? parse_launch_record(*bytes, key) : std::nullopt;
}

bool launch_record_store(const std::string& cache_dir, const LaunchRecord& record) {
  if (cache_dir.empty()) return false;
  return write_cache_file(cache_dir + "/launch", file_name(record.key), launch_record_bytes(record));
}

LaunchTuningCounters& launch_tuning_counters() {
  static LaunchTuningCounters counters;
  return counters;
}

}  // namespace ember::cuda
