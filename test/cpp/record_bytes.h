// For the tests of the tuned-choice records on disk (gemm_record_test.cpp, launch_tuning_test.cpp,
// thread_tuning_test.cpp): a record's bytes re-checksummed after a mutation, and mutated at random.
#pragma once

#include "backend/package/xxhash.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>

namespace ember::test {

// `bytes` with its trailing checksum (the XXH64 of everything before it) recomputed, so that a mutation reaches
// the parser itself.
inline std::string rechecksummed(std::string bytes) {
  if (bytes.size() < 8) return bytes;
  const uint64_t sum = xxh64(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size() - 8, 0);
  std::memcpy(&bytes[bytes.size() - 8], &sum, 8);
  return bytes;
}

// `good` (a record's bytes) after 1-4 random edits ahead of its checksum: a byte changed, 8 bytes of 0xff (a huge
// length), bytes cut or bytes inserted.
inline std::string mutated(const std::string& good, std::mt19937_64& rng) {
  std::string bytes = good;
  const int edits = 1 + static_cast<int>(rng() % 4);
  for (int e = 0; e < edits && bytes.size() >= 16; ++e) {
    const size_t at = rng() % (bytes.size() - 8);
    switch (rng() % 4) {
      case 0: bytes[at] = static_cast<char>(rng()); break;
      case 1: std::memset(&bytes[at], 0xff, std::min<size_t>(8, bytes.size() - 8 - at)); break;
      case 2: bytes.erase(at, 1 + rng() % 16); break;
      default: bytes.insert(at, std::string(1 + rng() % 16, static_cast<char>(rng())));
    }
  }
  return bytes;
}

}  // namespace ember::test
