// Record file: "EMBERGEM", u32 layout version, the key (u64 length, bytes), u8 route, i32 configuration,
// u64 workspace, the algorithm's 64 bytes, the winner's name (u64 length, bytes), u32 candidate count and per candidate its name (u64 length, bytes)
// and f32 milliseconds, then the XXH64 of everything before it. Little-endian as the host writes it (the key
// names the device, so a file never travels between hosts that would read it differently).
#include "kernels/cuda/gemm_record.h"

#include "kernels/cuda/disk_cache.h"
#include "kernels/cuda/record_io.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

namespace ember::cuda {
namespace {

using namespace record_io;

constexpr char kMagic[8] = {'E', 'M', 'B', 'E', 'R', 'G', 'E', 'M'};
constexpr uint32_t kLayoutVersion = 1;
constexpr uint32_t kMaxTimings = 4096;    // far above any problem's candidates
constexpr uint64_t kMaxNameBytes = 256;   // a candidate's name

}  // namespace

std::string gemm_record_bytes(const GemmRecord& r) {
  std::string out(kMagic, sizeof(kMagic));
  put(out, kLayoutVersion);
  put_string(out, r.key);
  put(out, r.route);
  put(out, r.config);
  put(out, r.workspace);
  out.append(reinterpret_cast<const char*>(r.algo.data()), r.algo.size());
  put_string(out, clipped(r.winner, kMaxNameBytes));
  put_timings(out, r.timings, kMaxTimings, kMaxNameBytes);
  put(out, checksum(out, out.size()));
  return out;
}

std::optional<GemmRecord> parse_gemm_record(const std::string& bytes, const std::string& key) {
  const size_t body = checked_body(bytes, kMagic);
  if (body == 0) return std::nullopt;
  Reader in(bytes, body);
  char magic[sizeof(kMagic)];
  uint32_t version = 0;
  GemmRecord r;
  if (!in.get(&magic) || !in.get(&version) || version != kLayoutVersion || !in.get_string(&r.key, body) ||
      r.key != key || !in.get(&r.route) || !in.get(&r.config) || !in.get(&r.workspace) || !in.get(&r.algo) ||
      !in.get_string(&r.winner, kMaxNameBytes))
    return std::nullopt;
  if (!get_timings(in, &r.timings, kMaxTimings, kMaxNameBytes) || !in.done()) return std::nullopt;
  return r;
}

std::optional<GemmRecord> gemm_record_find(const std::string& cache_dir, const std::string& key) {
  if (cache_dir.empty()) return std::nullopt;
  const std::optional<std::string> bytes = read_cache_file(cache_dir + "/gemm/" + file_name(key));
  return bytes ? parse_gemm_record(*bytes, key) : std::nullopt;
}

bool gemm_record_store(const std::string& cache_dir, const GemmRecord& record) {
  if (cache_dir.empty()) return false;
  return write_cache_file(cache_dir + "/gemm", file_name(record.key), gemm_record_bytes(record));
}

GemmTuningCounters& gemm_tuning_counters() {
  static GemmTuningCounters counters;
  return counters;
}

}  // namespace ember::cuda
