// For the tests of the tuned-choice records on disk (gemm_record_test.cpp, launch_tuning_test.cpp,
// thread_tuning_test.cpp): a record's bytes mutated where its trailing checksum cannot catch it.
#pragma once

#include "backend/package/xxhash.h"

#include <cstdint>
#include <cstring>
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

}  // namespace ember::test
