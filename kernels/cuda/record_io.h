// The byte helpers of the tuned-choice records under <cache dir> (gemm_record.cpp, launch_record.cpp): values
// appended as the host lays them out, a reader that refuses to run past its bytes, the file name and checksum
// (XXH64), the magic-and-checksum frame and the candidates' timings that both record kinds use.
#pragma once

#include "backend/package/xxhash.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace ember::cuda::record_io {

inline uint64_t checksum(const std::string& bytes, size_t n) {
  return xxh64(reinterpret_cast<const uint8_t*>(bytes.data()), n, 0);
}

// A record's file: the XXH64 of its key, in hex.
inline std::string file_name(const std::string& key) {
  char name[32];
  std::snprintf(name, sizeof(name), "%016llx.bin", static_cast<unsigned long long>(checksum(key, key.size())));
  return name;
}

template <class T>
void put(std::string& out, const T& v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

inline void put_string(std::string& out, const std::string& s) {
  put(out, static_cast<uint64_t>(s.size()));
  out += s;
}

// Reads from [pos, end) of a byte string, refusing anything that would run past `end`.
class Reader {
 public:
  Reader(const std::string& bytes, size_t end) : bytes_(bytes), end_(end) {}

  template <class T>
  bool get(T* v) {
    if (end_ - pos_ < sizeof(T)) return false;
    std::memcpy(v, bytes_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  bool get_string(std::string* s, uint64_t max_bytes) {
    uint64_t n = 0;
    if (!get(&n) || n > max_bytes || n > end_ - pos_) return false;
    s->assign(bytes_, pos_, static_cast<size_t>(n));
    pos_ += static_cast<size_t>(n);
    return true;
  }
  bool done() const { return pos_ == end_; }

 private:
  const std::string& bytes_;
  const size_t end_;
  size_t pos_ = 0;
};

// `name` cut to `max_bytes`.
inline std::string clipped(const std::string& name, uint64_t max_bytes) {
  return name.size() <= max_bytes ? name : name.substr(0, max_bytes);
}

// (name, milliseconds) of each timed candidate.
using Timings = std::vector<std::pair<std::string, float>>;

// u32 count, then per candidate its name (u64 length, bytes) and f32 milliseconds: at most `max_count`, names
// clipped to `max_name`.
inline void put_timings(std::string& out, const Timings& timings, uint32_t max_count, uint64_t max_name) {
  const uint32_t count = static_cast<uint32_t>(std::min<size_t>(timings.size(), max_count));
  put(out, count);
  for (uint32_t i = 0; i < count; ++i) {
    put_string(out, clipped(timings[i].first, max_name));
    put(out, timings[i].second);
  }
}

// put_timings' bytes back; false on a count or name past its limit, a non-finite time, or bytes that run out.
inline bool get_timings(Reader& in, Timings* timings, uint32_t max_count, uint64_t max_name) {
  uint32_t count = 0;
  if (!in.get(&count) || count > max_count) return false;
  timings->resize(count);
  for (auto& [name, ms] : *timings)
    if (!in.get_string(&name, max_name) || !in.get(&ms) || !std::isfinite(ms)) return false;
  return true;
}

// A record's frame: `magic` first, the XXH64 of everything before it last. The length of what the checksum covers
// where both hold, else 0.
inline size_t checked_body(const std::string& bytes, const char (&magic)[8]) {
  if (bytes.size() < sizeof(magic) + sizeof(uint64_t)) return 0;
  const size_t body = bytes.size() - sizeof(uint64_t);
  uint64_t stored = 0;
  std::memcpy(&stored, bytes.data() + body, sizeof(stored));
  if (std::memcmp(bytes.data(), magic, sizeof(magic)) != 0 || checksum(bytes, body) != stored) return 0;
  return body;
}

}  // namespace ember::cuda::record_io
