// The byte helpers of the tuned-choice records under <cache dir> (gemm_record.cpp, launch_record.cpp): values
// appended as the host lays them out, a reader that refuses to run past its bytes, and the file name and checksum
// (XXH64) both record kinds use.
#pragma once

#include "backend/package/xxhash.h"

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

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

}  // namespace ember::cuda::record_io
