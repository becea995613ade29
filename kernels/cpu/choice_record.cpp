// Record file: "EMBERCPU", u32 layout version, the key (u64 length, bytes), i64 choice, u32 candidate count and
// per candidate its name (u64 length, bytes) and f32 milliseconds, then the XXH64 of everything before it;
// little-endian as the host writes it (the key names the host).
#include "kernels/cpu/choice_record.h"

#include "kernels/cuda/disk_cache.h"
#include "kernels/cuda/record_io.h"

#include <ATen/Parallel.h>

#include <fstream>

namespace ember::cpu {
namespace {

using namespace cuda::record_io;

constexpr char kMagic[8] = {'E', 'M', 'B', 'E', 'R', 'C', 'P', 'U'};
constexpr uint32_t kLayoutVersion = 1;
constexpr uint32_t kMaxTimings = 64;    // far above any problem's candidates
constexpr uint64_t kMaxNameBytes = 64;  // a candidate's name

// /proc/cpuinfo's first "model name", read once; "" where there is none.
const std::string& cpu_model() {
  static const std::string model = [] {
    std::ifstream in("/proc/cpuinfo");
    for (std::string line; std::getline(in, line);)
      if (line.rfind("model name", 0) == 0) {
        const size_t colon = line.find(':');
        return colon == std::string::npos ? std::string() : line.substr(colon + 1);
      }
    return std::string();
  }();
  return model;
}

}  // namespace

std::string choice_record_host() {
  return std::string("ember ") + EMBER_VERSION + " cpu choice 1 built " + __DATE__ + " " + __TIME__ + "\ncpu" +
         cpu_model() + " threads " + std::to_string(at::get_num_threads()) + "\n";
}

std::string choice_record_bytes(const ChoiceRecord& r) {
  std::string out(kMagic, sizeof(kMagic));
  put(out, kLayoutVersion);
  put_string(out, r.key);
  put(out, r.choice);
  put_timings(out, r.timings, kMaxTimings, kMaxNameBytes);
  put(out, checksum(out, out.size()));
  return out;
}

std::optional<ChoiceRecord> parse_choice_record(const std::string& bytes, const std::string& key) {
  const size_t body = checked_body(bytes, kMagic);
  if (body == 0) return std::nullopt;
  Reader in(bytes, body);
  char magic[sizeof(kMagic)];
  uint32_t version = 0;
  ChoiceRecord r;
  if (!in.get(&magic) || !in.get(&version) || version != kLayoutVersion || !in.get_string(&r.key, body) ||
      r.key != key || !in.get(&r.choice) || !get_timings(in, &r.timings, kMaxTimings, kMaxNameBytes) || !in.done())
    return std::nullopt;
  return r;
}

std::optional<ChoiceRecord> choice_record_find(const std::string& key) {
  const std::string dir = cuda::disk_cache_dir();
  if (dir.empty()) return std::nullopt;
  const std::optional<std::string> bytes = cuda::read_cache_file(dir + "/cpu/" + file_name(key));
  return bytes ? parse_choice_record(*bytes, key) : std::nullopt;
}

bool choice_record_store(const ChoiceRecord& record) {
  const std::string dir = cuda::disk_cache_dir();
  if (dir.empty()) return false;
  return cuda::write_cache_file(dir + "/cpu", file_name(record.key), choice_record_bytes(record));
}

CpuTuningCounters& cpu_tuning_counters() {
  static CpuTuningCounters counters;
  return counters;
}

}  // namespace ember::cpu
